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
# # Lab 09 · Drafting and verifying tokens
#
# Speculative decoding guesses $k$ tokens cheaply, then lets the target model check them all in one
# step. You write the three small functions it rests on: the n-gram proposer (prompt lookup), greedy
# verification, and the random accept/resample rule that keeps the target's distribution exact. The
# checks compare them with `minillm/spec_decode/ngram.py` and `minillm/sampling/rejection_sampler.py`
# on fresh random inputs.

# %%
from minillm.labs import ch09

# %% [markdown]
# ## Exercise 1 — `ngram_propose`
#
# Take the last $n$ tokens of `tokens` (prompt and output so far). Find their **earliest** earlier
# occurrence, one that is followed by at least one token (so never the suffix itself), and propose the
# (up to) $k$ tokens that came after it. Try $n$ from `max_n` down to `min_n` (never more than
# `len(tokens) - 1`); the first $n$ that matches wins. No match: `[]`.
#
# Example: `tokens = [1, 2, 3, 4, 5, 1, 2, 3]`, $n = 3$: the suffix `[1, 2, 3]` occurs at 0, followed by
# `[4, 5, 1, 2, ...]`, so with $k = 4$ the proposal is `[4, 5, 1, 2]`.

# %%
def ngram_propose(tokens, min_n, max_n, k):
    ### BEGIN SOLUTION
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for i in range(0, L - n):  # windows that end before the last token
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []
    ### END SOLUTION


# %% tags=["check"]
ch09.check_ngram_propose(ngram_propose)

# %% [markdown]
# ## Exercise 2 — `verify_greedy`
#
# The target ran on the last token and the $k$ drafts $d_1, \dots, d_k$ and gave its argmax at each of
# the $k + 1$ positions: `target_argmax[j]` is its choice for the token after $d_j$ (after the last
# token for $j = 0$). Greedy decoding would have produced exactly the target's choices, so: keep $d_j$
# while it equals `target_argmax[j]`; at the first mismatch emit `target_argmax[j]` instead and stop;
# if all $k$ match, emit the bonus `target_argmax[k]`. One step always emits between 1 and $k + 1$ tokens.

# %%
def verify_greedy(draft_tokens, target_argmax):
    ### BEGIN SOLUTION
    out = []
    for d, t in zip(draft_tokens, target_argmax):
        if d != t:
            return out + [t]
        out.append(d)
    return out + [target_argmax[len(draft_tokens)]]
    ### END SOLUTION


# %% tags=["check"]
ch09.check_verify_greedy(verify_greedy)

# %% [markdown]
# ## Exercise 3 — `speculative_accept`
#
# Now the drafts were *sampled*: $d_j \sim q_j$ (`q[j]`, a list of probabilities), and the target's
# distributions are $p_0, \dots, p_k$ (`p[j]`). Walk the drafts in order:
#
# - accept $d_j$ with probability $\min(1, p_j(d_j) / q_j(d_j))$: with the given uniform `coins[j]`,
#   accept when `coins[j] * q[j][d] <= p[j][d]`;
# - at the first rejection, emit a token drawn from the residual $\max(p_j - q_j, 0)$: call
#   `pick(weights)` with that list (unnormalized is fine; if it is all zero, pass `p[j]`), and stop;
# - if all $k$ are accepted, emit `pick(p[k])`, the bonus token.
#
# Then every emitted token has exactly the target's distribution: $P(x) = \min(p, q)(x) +
# (1 - \sum_y \min(p, q)(y)) \cdot \text{residual}(x) = p(x)$ (Leviathan et al., 2023).

# %%
def speculative_accept(p, q, drafts, coins, pick):
    ### BEGIN SOLUTION
    out = []
    for j, d in enumerate(drafts):
        if coins[j] * q[j][d] <= p[j][d]:
            out.append(d)
            continue
        residual = [max(a - b, 0.0) for a, b in zip(p[j], q[j])]
        return out + [pick(residual if sum(residual) > 0 else list(p[j]))]
    return out + [pick(list(p[len(drafts)]))]
    ### END SOLUTION


# %% tags=["check"]
ch09.check_speculative_accept(speculative_accept)
