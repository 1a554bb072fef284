"""The vocabulary-aligned token index: for every automaton node, which tokens may come next.

Outlines' idea, for a DFA: walk every token from every state once, at compile time, and keep per state
the set of tokens that do not fall off the automaton. A request's mask is then one row of a table.

XGrammar's idea, for a pushdown automaton, where a node's allowed tokens can depend on the stack below
it: split each node's tokens into
  * context-independent ones, decided at compile time: accepted while staying inside this node's rule
    (calls it makes are pushed and known) or rejected inside it;
  * context-dependent ones (`mid`): they finish this rule part-way through the token and hand the rest
    to a caller nobody knows yet. They are few (tokens like `"},` at the end of a string) and are
    walked at run time against the real stack.
The walk over all (state, token) pairs is vectorized with numpy: the pairs live in flat arrays and
each step reads one byte column of the padded token matrix. Only tokens that touch a rule boundary
mid-token (a call or a possible return) are walked again in Python, exactly, with stacks.
"""

from __future__ import annotations

import numpy as np

from .grammar import PDA
from .vocab import TokenVocab

_CHUNK = 128  # states per batch of the vectorized walk: bounds the [states, tokens] temporaries
STACK_CACHE_SIZE = 16384  # x 6 KB per entry at a 49k vocabulary
BITS = (np.uint32(1) << np.arange(32, dtype=np.uint32)).view(np.int32)  # [32] one bit each


def pack_bits(allowed: np.ndarray, num_words: int) -> np.ndarray:
    """[..., V] bool -> [..., num_words] int32, bit i of word w = token 32*w + i (xgrammar's layout)."""
    pad = num_words * 32 - allowed.shape[-1]
    if pad:
        allowed = np.concatenate([allowed, np.zeros(allowed.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    return np.packbits(allowed, axis=-1, bitorder="little").view("<i4")


def unpack_bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Inverse of pack_bits: [..., W] int32 -> [..., V] bool."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size].astype(bool)


class TokenIndex:
    """acc: [N, W] int32 context-independent accepted tokens per node; mid[n]: context-dependent token
    ids of node n; exit0[n]: the node's rule may end before the token, so the caller's tokens count."""

    def __init__(self, pda: PDA, vocab: TokenVocab):
        self.pda, self.vocab = pda, vocab
        N, W = pda.num_nodes, vocab.num_words
        self.acc = np.zeros((N, W), dtype=np.int32)
        cand = self._vectorized_walk()
        self.mid: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * N
        # exit0[n]: the rule of node n may end right here (before the token), so what its caller
        # allows next counts too; never for the root rule, whose end is the end of the output.
        self.exit0 = pda.end_ok & (pda.rule_of != pda.names.index("$root"))
        self.num_python_walks = 0
        self._stack_masks: dict[int, np.ndarray] = {}
        state = np.zeros(N, dtype=np.int8)  # 0 todo, 1 in progress, 2 done
        for n in range(N):
            self._resolve(n, cand, state)

    def _vectorized_walk(self) -> list[set]:
        """Walk every token from every node along byte edges. Fills self.acc with the tokens read to
        their end; returns, per node, the tokens that died after meeting a byte that another parse
        could read across a rule boundary (a call or a return): those need the exact walk."""
        pda, v = self.pda, self.vocab
        N = pda.num_nodes
        escape = pda.escape  # [N, 256]: a byte node n could also read by a call or a return
        first_sorted = v.mat[v.by_first, 0]  # [T] first byte of each real token, sorted
        cand: list[set] = [set() for _ in range(N)]
        for lo in range(0, N, _CHUNK):
            nodes = np.arange(lo, min(N, lo + _CHUNK))
            valid = pda.trans[nodes] >= 0  # [n, 256]
            sel = valid[:, first_sorted]  # [n, T]: token starts with a byte the node can read
            ni, ti = np.nonzero(sel)
            node, tok = nodes[ni], v.by_first[ti]  # [P] pairs
            state = pda.trans[node, v.mat[tok, 0]]
            touched = np.zeros(len(tok), dtype=bool)  # position-0 calls/returns: composed in _resolve
            accepted = np.zeros((len(nodes), v.vocab_size), dtype=bool)  # [n, V]
            pos = 1
            while len(tok):
                done = v.lengths[tok] == pos
                accepted[node[done] - lo, tok[done]] = True
                keep = ~done
                node, tok, state, touched = node[keep], tok[keep], state[keep], touched[keep]
                if not len(tok):
                    break
                byte = v.mat[tok, pos]
                touched |= escape[state, byte]  # another parse may take this byte across a boundary
                nxt = pda.trans[state, byte]
                dead = nxt < 0
                for n_, t_ in zip(node[dead & touched].tolist(), tok[dead & touched].tolist()):
                    cand[n_].add(t_)
                alive = ~dead
                node, tok, state = node[alive], tok[alive], nxt[alive]
                touched = touched[alive]
                pos += 1
            self.acc[nodes] = pack_bits(accepted, v.num_words)
        return cand

    def _resolve(self, n: int, cand: list[set], state: np.ndarray) -> None:
        """Compose node n's classes with its callees' (pushing is context-independent), then decide
        the leftover candidates by walking them exactly, relative to n's frame."""
        if state[n] == 2 or state[n] == 1:  # 1: a cycle through empty rules; its members share one set
            return
        state[n] = 1
        pda = self.pda
        todo = set(cand[n])
        for c, r in pda.calls[n]:
            for m in (c, r) if pda.end_ok[c] else (c,):
                self._resolve(m, cand, state)
                self.acc[n] |= self.acc[m]
                todo.update(self.mid[m].tolist())
        mid = []
        tb, row = self.vocab.token_bytes, self.acc[n]
        todo = sorted((t for t in todo if not row[t >> 5] >> (t & 31) & 1), key=lambda t: tb[t])
        self.num_python_walks += len(todo)
        for t, (stacks, escaped) in zip(todo, pda.walk_sorted({pda.stack(-1, n)}, [tb[t] for t in todo], relative=True)):
            if stacks:
                row[t >> 5] |= BITS[t & 31]
            elif escaped:
                mid.append(t)
        self.mid[n] = np.array(mid, dtype=np.int64)
        state[n] = 2

    def stack_mask(self, stack: int, out: np.ndarray) -> None:
        """OR into `out` ([W] int32) the tokens allowed on top of this stack (EOS not included).

        mask(stack) = acc[top] | the top's context-dependent tokens that the real stack accepts |
        mask(stack minus top) if the top's rule may end here. Cached per stack, shared by all
        requests: the caller stacks below a new nesting depth are the ones seen before."""
        m = self._stack_masks.get(stack)
        if m is None:
            pda, tb = self.pda, self.vocab.token_bytes
            n, parent = pda._node[stack], pda._parent[stack]
            m = self.acc[n].copy()
            for t in self.mid[n].tolist():
                if not m[t >> 5] >> (t & 31) & 1 and pda.walk({stack}, tb[t])[0]:
                    m[t >> 5] |= BITS[t & 31]
            if self.exit0[n] and parent >= 0:
                self.stack_mask(parent, m)  # the rule may end here: its caller's tokens count too
            if len(self._stack_masks) >= STACK_CACHE_SIZE:
                self._stack_masks.clear()
            self._stack_masks[stack] = m
        out |= m
