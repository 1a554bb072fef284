# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 14 · Structured output
#
# A request that must answer in a regular expression's language gets, at every step, a **token mask**:
# one bit per vocabulary token, set where the token may come next. Two pieces of chapter 14 make it.
# First the compile-time step that turns an automaton over *bytes* into masks over *tokens*: for one
# state of the regex's DFA, walk every token's bytes through the DFA and pack the survivors into int32
# words. Then the run-time step at the worker's one mask point: every logit whose bit is 0 becomes
# $-\infty$, so whatever samples next picks among the grammar's tokens.
#
# The checks run your functions **inside the engine**: a tiny random Llama over the first 1,024 tokens
# of SmolLM2's real vocabulary, fresh random regexes each time. Your masks become the engine's token
# index, and the bitmask the engine hands the worker at every step is compared with xgrammar's.

# %%
import numpy as np
import torch

from minillm.labs import ch14
from minillm.structured_output import parse_regex
from minillm.structured_output.automaton import compile_dfa

# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch14.hint("dfa_token_bitmask", 1)`, then 2, then 3. This lists the exercises:

# %%
ch14.hint()

# %% [markdown]
# ## A DFA over bytes, a vocabulary of tokens
#
# `compile_dfa(parse_regex(r))` is minillm's regex → NFA → DFA → minimal DFA (automaton.py). Its
# table `trans[state, byte]` gives the next state, or -1 where the byte is not allowed; `final[state]`
# says the output may end there. It is *pruned*: every state it can reach can still reach a final
# state, so a token that survives the walk never leads into a dead end.
#
# The vocabulary is what the model samples from, and its tokens do not respect the regex's pieces:
# `' the'` is four bytes, `'ing'` three. That is the **token boundary problem**: a token is allowed
# when *all* its bytes walk through the DFA, wherever they land, even in the middle of what the
# regex sees as two parts.

# %%
dfa = compile_dfa(parse_regex(r"(the|a) [a-z]+ing"))
vocab = ch14.lab_tokenizer().vocab
print(f"{dfa.num_states} states; start {dfa.start}; final states {np.nonzero(dfa.final)[0].tolist()}")


def walk(state, data: bytes):
    for b in data:
        state = int(dfa.trans[state, b])
        if state < 0:
            return None
    return state


for t in (b"the", b"th", b" the", b"a", b" s", b"ing", b"at"):
    print(f"{t!r:8} from the start -> {walk(dfa.start, t)}")

# %% [markdown]
# ## Exercise 1 — from a DFA state to a token bitmask
#
# Write `dfa_token_bitmask(trans, final, state, token_bytes, stop_ids)`:
#
# - `trans` `[S, 256]` int32 and `final` `[S]` bool: the DFA; `state`: the state to answer for;
# - `token_bytes[t]`: the bytes of token `t` (`b""` for a special token: never allowed);
# - `stop_ids`: the EOS-like tokens, allowed exactly when `final[state]`.
#
# Return the packed mask, `[ceil(V / 32)]` int32 with `V = len(token_bytes)`: bit `t % 32` of word
# `t // 32` set when token `t` is allowed (xgrammar's layout, the one the engine and both backends
# fill). Bit 31 is the sign bit of an int32, so word values are negative whenever token `32w + 31`
# is allowed. The engine computes these rows for all states at once with numpy (token_index.py);
# a plain loop is fine here: a lab DFA has a few dozen states and the vocabulary 1,024 tokens.

# %%
def dfa_token_bitmask(trans: np.ndarray, final: np.ndarray, state: int, token_bytes: list[bytes],
                      stop_ids: list[int]) -> np.ndarray:
    ### BEGIN SOLUTION
    V = len(token_bytes)
    ok = np.zeros(32 * ((V + 31) // 32), dtype=bool)  # [32W] one bool per token, padded
    for t, data in enumerate(token_bytes):
        s = state
        for b in data:
            s = trans[s, b]
            if s < 0:
                break
        ok[t] = bool(data) and s >= 0  # a special token (no bytes) is never text
    for t in stop_ids:
        ok[t] = bool(final[state])  # EOS only where the output may end
    return np.packbits(ok, bitorder="little").view("<i4")  # [W] bit t%32 of word t//32
    ### END SOLUTION


# %% tags=["check"]
ch14.check_dfa_token_bitmask(dfa_token_bitmask)

# %% [markdown]
# ## Exercise 2 — the mask point
#
# Write `apply_bitmask(logits, bitmask)`: `logits` `[B, V]` float, `bitmask` `[B, W]` int32 on the
# same device; return the logits with every token whose bit is 0 set to $-\infty$ (in place or a new
# tensor). If the logits are wider than the mask covers (`V > 32 W`: a vocabulary padded for the
# GPU), leave the columns past `32 W` as they are. The check compares you with minillm's
# `apply_token_bitmask` on random masks (none allowed, a few, half, all), then puts your function at the
# worker's mask point (`sampling/token_mask.py`) and runs a batch of constrained and free requests:
# the tokens must be the engine's own.

# %%
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    ### BEGIN SOLUTION
    V = min(logits.shape[1], 32 * bitmask.shape[1])
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]; >> on int32 keeps bit 31 as the sign, & 1 clears it
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :V].bool()  # [B, V]
    logits[:, :V] = logits[:, :V].masked_fill(~allowed, float("-inf"))
    return logits
    ### END SOLUTION


# %% tags=["check"]
ch14.check_apply_bitmask(apply_bitmask)

# %% [markdown]
# ## What you built
#
# Exercise 1 is Outlines' index (Willard & Louf, 2023) for one state. The engine's version,
# `minillm/structured_output/token_index.py`, walks all (state, token) pairs at once as numpy arrays, one
# byte column at a time, and extends it to a pushdown automaton for JSON: tokens that stay inside one rule
# are decided at compile time (XGrammar's context-independent tokens), the few that cross a rule's end
# are walked at run time against the real stack. Exercise 2 is `minillm/structured_output/bitmask.py`'s
# plain-PyTorch reference; `kernels/token_bitmask.py` does the same in one Triton launch, reading the
# logits once and writing $-\infty$ only where a bit is 0.
