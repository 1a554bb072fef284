"""IR -> NFA (Thompson) -> DFA (subset construction) -> minimal DFA (Moore's partition refinement).

The DFA reads bytes; a remaining rule reference (`Ref`) becomes a *call edge*, a symbol of its own
that a pushdown automaton (grammar.py) follows by pushing the callee. A rule with no call edges is a
plain DFA, and the whole request is then a table lookup per byte.

Subset construction runs over byte *classes*, not 256 bytes: bytes that every edge treats alike (say,
all letters in a string body) are one class, so a DFA state is built from a few dozen symbols.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ir

MAX_DFA_STATES = 20_000  # a guard against exponential blow-up (a{0,50} inside alternations, etc.)


@dataclass
class DFA:
    """start: the initial state; trans: [S, 256] int32 next state per byte, -1 = no edge;
    final: [S] bool; calls[s]: list of (rule name, state after the call returns)."""

    start: int
    trans: np.ndarray
    final: np.ndarray
    calls: list[list[tuple[str, int]]]

    @property
    def num_states(self) -> int:
        return len(self.final)

    def has_calls(self) -> bool:
        return any(self.calls)

    def fullmatch(self, data: bytes) -> bool:
        """For a DFA without calls: does it accept exactly these bytes?"""
        s = self.start
        for b in data:
            s = int(self.trans[s, b])
            if s < 0:
                return False
        return bool(self.final[s])


class _NFA:
    def __init__(self):
        self.eps: list[list[int]] = []
        self.bytes: list[list[tuple[int, int]]] = []  # per state: (mask, dst)
        self.calls: list[list[tuple[str, int]]] = []

    def new(self) -> int:
        self.eps.append([])
        self.bytes.append([])
        self.calls.append([])
        return len(self.eps) - 1

    def build(self, node, s: int) -> int:
        """Add `node` starting at state s; return its end state."""
        if isinstance(node, ir.Bytes):
            e = self.new()
            self.bytes[s].append((node.mask, e))
            return e
        if isinstance(node, ir.Seq):
            for it in node.items:
                s = self.build(it, s)
            return s
        if isinstance(node, ir.Alt):
            e = self.new()
            for it in node.items:
                b = self.new()
                self.eps[s].append(b)
                self.eps[self.build(it, b)].append(e)
            return e
        if isinstance(node, ir.Rep):
            for _ in range(node.lo):
                s = self.build(node.item, s)
            if node.hi is None:  # star: a hub of its own that the body loops back to, and a fresh
                hub, out = self.new(), self.new()  # exit: looping back to `s` itself would let
                self.eps[s].append(hub)  # whatever follows the star jump back into it
                self.eps[self.build(node.item, hub)].append(hub)
                self.eps[hub].append(out)
                return out
            e = self.new()
            self.eps[s].append(e)
            for _ in range(node.hi - node.lo):  # optional copies, each may stop the repetition
                s = self.build(node.item, s)
                self.eps[s].append(e)
            return e
        if isinstance(node, ir.Ref):
            e = self.new()
            self.calls[s].append((node.name, e))
            return e
        raise TypeError(f"not an IR node: {node!r}")


def compile_dfa(node, what: str = "expression") -> DFA:
    """IR expression -> minimal DFA. Raises ValueError when it matches nothing or grows too large."""
    nfa = _NFA()
    start = nfa.new()
    end = nfa.build(node, start)
    closure = _closures(nfa)

    # Byte classes: refine the partition of 0..255 by every edge's byte set.
    classes = [ir.ALL_BYTES]
    for mask in {m for edges in nfa.bytes for m, _ in edges}:
        classes = [p for c in classes for p in (c & mask, c & ~mask) if p]
    edge_classes = {m: [k for k, c in enumerate(classes) if c & m] for edges in nfa.bytes for m, _ in edges}
    names = sorted({n for cs in nfa.calls for n, _ in cs})
    C, K = len(classes), len(names)

    # Subset construction over C byte classes and K call symbols.
    first = closure[start]
    index = {first: 0}
    sets, rows = [first], []
    while len(rows) < len(sets):
        d = sets[len(rows)]
        targets: list[set[int]] = [set() for _ in range(C + K)]
        for s in d:
            for mask, dst in nfa.bytes[s]:
                for k in edge_classes[mask]:
                    targets[k] |= closure[dst]
            for name, dst in nfa.calls[s]:
                targets[C + names.index(name)] |= closure[dst]
        row = []
        for t in targets:
            if not t:
                row.append(-1)
                continue
            key = frozenset(t)
            if key not in index:
                index[key] = len(sets)
                sets.append(key)
                if len(sets) > MAX_DFA_STATES:
                    raise ValueError(f"{what}: the automaton grows past {MAX_DFA_STATES} states; simplify it")
            row.append(index[key])
        rows.append(row)
    table = np.array(rows, dtype=np.int64).reshape(len(sets), C + K)  # [S, C + K]
    final = np.array([end in d for d in sets])
    table, final, start_state = _prune_and_minimize(table, final, what)

    # Expand classes back to bytes: [S, C] -> [S, 256].
    cls_of_byte = np.zeros(256, dtype=np.int64)
    for k, c in enumerate(classes):
        for b in range(256):
            if c >> b & 1:
                cls_of_byte[b] = k
    trans = table[:, cls_of_byte].astype(np.int32)  # [S, 256]
    calls = [[(names[j], int(table[s, C + j])) for j in range(K) if table[s, C + j] >= 0] for s in range(len(final))]
    return DFA(start=start_state, trans=trans, final=final, calls=calls)


def _closures(nfa: _NFA) -> list[frozenset]:
    """Epsilon closure of every NFA state."""
    out = []
    for s in range(len(nfa.eps)):
        seen, stack = {s}, [s]
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        out.append(frozenset(seen))
    return out


def _prune_and_minimize(table: np.ndarray, final: np.ndarray, what: str):
    """Drop states from which no final state is reachable (a token leading there could never finish,
    so it must not be allowed), then merge equivalent states. Returns (table, final, start)."""
    S = len(final)
    live = final.copy()
    src, sym = np.nonzero(table >= 0)
    dst = table[src, sym]
    while True:  # backward reachability from the final states
        grow = live.copy()
        grow[src[live[dst]]] = True
        if (grow == live).all():
            break
        live = grow
    if not live[0]:
        raise ValueError(f"{what} matches no string")
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, -1)
    keep = np.nonzero(live)[0]
    renum = -np.ones(S + 1, dtype=np.int64)
    renum[keep] = np.arange(len(keep))
    table = renum[table[keep]]  # -1 maps to renum[-1] = -1
    final = final[keep]

    # Moore: split blocks until a state's block and its successors' blocks determine each other.
    block = final.astype(np.int64)
    n_blocks = len(np.unique(block))
    while True:
        succ = np.where(table >= 0, block[np.maximum(table, 0)], -1)  # [S, C + K]
        sig = np.concatenate([block[:, None], succ], axis=1)
        _, block = np.unique(sig, axis=0, return_inverse=True)
        block = block.reshape(-1)
        if block.max() + 1 == n_blocks:
            break
        n_blocks = block.max() + 1
    # Renumber blocks so the start state's block is 0 (the start is row 0 after pruning).
    order = np.full(n_blocks, -1)
    rep = np.zeros(n_blocks, dtype=np.int64)
    nxt = 0
    for s in range(len(block)):
        if order[block[s]] < 0:
            order[block[s]] = nxt
            rep[nxt] = s
            nxt += 1
    mapping = np.append(order, -1)  # index -1 -> -1
    new_table = np.where(table[rep] >= 0, mapping[block[np.maximum(table[rep], 0)]], -1)
    return new_table, final[rep], 0
