"""A request's position in its grammar, and the token bitmask for its next step.

    compiled = compiler.compile(params)         # cached by the spec's hash (compiler.py)
    m = Matcher(compiled)
    m.fill_bitmask(bitmask[i])                  # host side, while the GPU runs the forward
    ...  apply_token_bitmask(logits, bitmask)   # device side, one point before sampling
    m.accept_token(sampled_id)

The state is a set of stacks (see grammar.py): one for an unambiguous grammar, one of a single node
for a regex. A mask is cached per state in the CompiledGrammar, shared by all the requests that use
it: JSON generation keeps coming back to the same configurations (inside a string, after a comma).
"""

from __future__ import annotations

import numpy as np

from .grammar import PDA
from .token_index import BITS, TokenIndex, unpack_bits
from .vocab import TokenVocab

MASK_CACHE_SIZE = 8192


class CompiledGrammar:
    """A PDA plus its token index over one vocabulary; immutable, shared between requests."""

    def __init__(self, pda: PDA, vocab: TokenVocab, source: str = "", compile_ms: float = 0.0):
        self.pda, self.vocab, self.source = pda, vocab, source
        self.index = TokenIndex(pda, vocab)
        self.compile_ms = compile_ms
        self._masks: dict[frozenset, np.ndarray] = {}

    def mask_for(self, stacks: frozenset) -> np.ndarray:
        """[W] int32 allowed tokens (EOS included when the output may end here) for a state."""
        m = self._masks.get(stacks)
        if m is not None:
            return m
        m = np.zeros(self.vocab.num_words, dtype=np.int32)
        for s in stacks:  # a regex has one stack of one node: this is one row of the index
            self.index.stack_mask(s, m)
        if any(self.pda.accepts_end(s) for s in stacks):
            for t in self.vocab.stop_ids:
                m[t >> 5] |= BITS[t & 31]
        if len(self._masks) >= MASK_CACHE_SIZE:
            self._masks.clear()
        self._masks[stacks] = m
        return m

    def set_index_rows(self, acc: np.ndarray) -> None:
        """Swap in a token index computed elsewhere: acc [N, W] int32, row n the tokens allowed at node
        n (EOS may be in it; the matcher adds EOS where the output may end anyway), and forget every
        mask made from the old one. Only for a grammar without calls (a regex, a choice), whose rows
        are the whole answer. Chapter 14's lab plugs the student's DFA-to-token-index step in here."""
        if self.pda.has_calls:
            raise ValueError(f"{self.source}: set_index_rows needs a grammar without calls (a regex or a choice)")
        if not isinstance(acc, np.ndarray) or acc.shape != self.index.acc.shape or acc.dtype != np.int32:
            raise ValueError(f"acc must be an int32 array of shape {self.index.acc.shape}, got "
                             f"{getattr(acc, 'dtype', type(acc))} {getattr(acc, 'shape', '')}")
        self.index.acc[:] = acc
        self.index._stack_masks.clear()
        self._masks.clear()

    @property
    def num_nodes(self) -> int:
        return self.pda.num_nodes


class Matcher:
    """One request's matcher. max_rollback: how many accepted tokens rollback() may undo (speculative
    decoding rejects a suffix of draft tokens); None keeps them all."""

    def __init__(self, compiled: CompiledGrammar, max_rollback: int | None = None):
        self.compiled = compiled
        self.max_rollback = max_rollback
        self._start = frozenset({compiled.pda.stack(-1, compiled.pda.start)})
        self.reset()

    def reset(self) -> None:
        self.state = self._start
        self._history: list[frozenset] = []
        self._terminated = False

    def is_terminated(self) -> bool:
        """True after a stop token was accepted: the request must end."""
        return self._terminated

    def can_end(self) -> bool:
        return any(self.compiled.pda.accepts_end(s) for s in self.state)

    def fill_bitmask(self, bitmask_row) -> None:
        """Write this step's allowed tokens into `bitmask_row` ([ceil(V/32)] int32, CPU tensor or
        numpy array; bit set = allowed). A terminated matcher allows only the stop tokens."""
        row = bitmask_row.numpy() if hasattr(bitmask_row, "numpy") else bitmask_row
        if row.shape != (self.compiled.vocab.num_words,):
            raise ValueError(f"bitmask row has shape {tuple(row.shape)}, expected ({self.compiled.vocab.num_words},)")
        if self._terminated:
            row[:] = 0
            for t in self.compiled.vocab.stop_ids:
                row[t >> 5] |= BITS[t & 31]
            return
        np.copyto(row, self.compiled.mask_for(self.state))

    def allowed_tokens(self) -> np.ndarray:
        """The allowed token ids, sorted (for tests and debugging)."""
        row = np.zeros(self.compiled.vocab.num_words, dtype=np.int32)
        self.fill_bitmask(row)
        return np.nonzero(unpack_bits(row, self.compiled.vocab.vocab_size))[0]

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        if self._terminated:
            return False
        vocab = self.compiled.vocab
        if token_id in vocab.stop_ids:
            if not self.can_end():
                return False
            self._push(self.state)
            self._terminated = True
            return True
        if not 0 <= token_id < len(vocab.token_bytes) or not vocab.token_bytes[token_id]:
            return False
        stacks, _ = self.compiled.pda.walk(self.state, vocab.token_bytes[token_id])
        if not stacks:
            return False
        self._push(frozenset(stacks))
        return True

    def accept_string(self, text: str | bytes) -> bool:
        """Advance by raw bytes (not tokens); used by tests and jump-forward."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        stacks, _ = self.compiled.pda.walk(self.state, data)
        if not stacks:
            return False
        self._push(frozenset(stacks))
        return True

    def forced_bytes(self, limit: int = 256) -> bytes:
        """The bytes the grammar forces next (one possible byte at each step, and the output may not
        end before them): what jump-forward decoding may append without sampling. Does not move."""
        pda, out, stacks = self.compiled.pda, bytearray(), self.state
        while len(out) < limit and not self._terminated:
            closed = pda.closure(stacks)[0] if pda.has_calls else stacks
            if any(pda.accepts_end(s) for s in closed):
                break
            nxt = {int(b) for s in closed for b in np.nonzero(pda.trans[pda._node[s]] >= 0)[0]}
            if len(nxt) != 1:
                break
            b = nxt.pop()
            out.append(b)
            stacks = pda.step(closed, b)
        return bytes(out)

    def _push(self, new_state: frozenset) -> None:
        self._history.append(self.state)
        if self.max_rollback is not None and len(self._history) > self.max_rollback:
            del self._history[0]
        self.state = new_state

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} can be undone")
        for _ in range(num_tokens):
            self.state = self._history.pop()
            self._terminated = False
