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
# step. You write what it rests on: the n-gram proposer (prompt lookup), greedy verification, the
# acceptance model that says how many tokens a step gets and how many drafts to make, and the random
# accept/resample rule that keeps the target's distribution exact — first for one sequence, then for a
# whole flattened batch in tensor operations, as the engine runs it. The checks compare your functions
# with `minillm/spec_decode/ngram.py`, `minillm/spec_decode/acceptance.py` and minillm's
# `RejectionSampler` itself (`minillm/sampling/rejection_sampler.py`) on fresh random inputs.
#
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run `ch09.hint("name", 1)`, then
# 2, then 3.

# %%
from minillm.labs import ch09

ch09.hint()

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
# ## Exercise 3 — the acceptance model
#
# A draft $x$ sampled from $q$ is kept with probability $\min(1, p(x)/q(x))$. Write
#
# - `acceptance_rate(p, q)`: the probability that a draft is accepted, for target and draft
#   distributions given as lists ($= 1 - \mathrm{TV}(p, q)$);
# - `expected_tokens(alpha, k)`: the mean number of tokens a verify step with $k$ drafts emits when each
#   draft is accepted independently with probability $\alpha$ (the accepted prefix, plus one token);
# - `best_k(alpha, c, k_max)`: the $k \in \{0, \dots, k_{max}\}$ with the highest expected speedup when a
#   draft token costs $c$ decode steps and a verify step costs one: $E[\text{tokens}] / (1 + c k)$. On a tie
#   the smaller $k$.

# %%
def acceptance_rate(p, q):
    ### BEGIN SOLUTION
    return sum(min(a, b) for a, b in zip(p, q))
    ### END SOLUTION


def expected_tokens(alpha, k):
    ### BEGIN SOLUTION
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    ### END SOLUTION


def best_k(alpha, c, k_max):
    ### BEGIN SOLUTION
    def speedup(k):
        return expected_tokens(alpha, k) / (1 + c * k)

    best = 0
    for k in range(1, k_max + 1):
        if speedup(k) > speedup(best):
            best = k
    return best
    ### END SOLUTION


# %% tags=["check"]
ch09.check_acceptance_rate(acceptance_rate)
ch09.check_expected_tokens(expected_tokens)
ch09.check_best_k(best_k)

# %% [markdown]
# ## Exercise 4 — `speculative_accept`
#
# Now the drafts were *sampled*: $d_j \sim q_j$ (`q[j]`, a list of probabilities), and the target's
# distributions are $p_0, \dots, p_k$ (`p[j]`). Walk the drafts in order:
#
# - accept $d_j$ with probability $\min(1, p_j(d_j) / q_j(d_j))$: with the given uniform `coins[j]`,
#   accept when `coins[j] * q[j][d] <= p[j][d]`;
# - at the first rejection, emit a token drawn from the residual $\max(p_j - q_j, 0)$: call
#   `pick(j, weights)` with that list (unnormalized is fine; if it is all zero, pass `p[j]`), and stop;
# - if all $k$ are accepted, emit `pick(k, p[k])`, the bonus token.
#
# Then every emitted token has exactly the target's distribution: $P(x) = \min(p, q)(x) +
# (1 - \sum_y \min(p, q)(y)) \cdot \text{residual}(x) = p(x)$ (Leviathan et al., 2023). The check runs
# minillm's `RejectionSampler` on the same sequence and gives you its own coins, and a `pick` that makes
# the sampler's own random draw at row $j$, so a correct rule emits exactly the sampler's tokens.

# %%
def speculative_accept(p, q, drafts, coins, pick):
    ### BEGIN SOLUTION
    out = []
    for j, d in enumerate(drafts):
        if coins[j] * q[j][d] <= p[j][d]:
            out.append(d)
            continue
        residual = [max(a - b, 0.0) for a, b in zip(p[j], q[j])]
        return out + [pick(j, residual if sum(residual) > 0 else list(p[j]))]
    return out + [pick(len(drafts), list(p[len(drafts)]))]
    ### END SOLUTION


# %% tags=["check"]
ch09.check_speculative_accept(speculative_accept)

# %% [markdown]
# ## Exercise 5 — `batched_accept`: the whole batch at once
#
# The engine verifies every sequence of a step in one call, on a flattened layout (vLLM's): sequence $b$
# has `num_draft[b]` $= k_b$ drafts and $k_b + 1$ rows of target probabilities, side by side.
#
# | input | shape | holds |
# |---|---|---|
# | `p` | `[R, V]`, $R = \sum_b (k_b + 1)$ | target distributions, sequence $b$'s rows together |
# | `q` | `[D, V]`, $D = \sum_b k_b$ | the distribution each draft was sampled from |
# | `draft_token_ids` | `[D]` | the drafts, in the same order |
# | `coins` | `[D]` | one uniform per draft |
# | `race_uniforms` | `[R, V]` | the uniforms of each row's random draw |
#
# Apply the rule of exercise 4 to every draft with tensor operations (no Python loop over drafts or rows):
# `accepted = coins * q[i, d_i] <= p[row_i, d_i]`; a row's draw picks from `weights` — the residual
# $\max(p - q, 0)$ on a draft's row (its $p$ where the residual is all zero), $p$ itself on each sequence's
# last row — with the exponential race `argmax(weights / -log(race_uniforms))`, which picks token $i$ with
# probability $w_i / \sum w$. Then return, per sequence, its drafts while accepted and the drawn token of
# the first rejected row (or of its last row). This is what `RejectionSampler` does; the check compares
# your tokens with it.

# %%
import torch


def batched_accept(p, q, draft_token_ids, num_draft, coins, race_uniforms):
    ### BEGIN SOLUTION
    starts = [0]
    for k in num_draft:
        starts.append(starts[-1] + k + 1)
    rows = torch.tensor([s + j for s, k in zip(starts, num_draft) for j in range(k)], dtype=torch.long)  # [D]
    d = draft_token_ids  # [D]
    accepted = coins * q.gather(1, d[:, None])[:, 0] <= p[rows, d]  # [D]
    residual = (p[rows] - q).clamp_min(0.0)  # [D, V]
    weights = p.clone()  # [R, V]: the last row of each sequence draws from p
    weights[rows] = torch.where(residual.sum(-1, keepdim=True) <= 0, p[rows], residual)
    tokens = (weights / -torch.log(race_uniforms)).argmax(dim=-1).tolist()  # [R]
    accepted, d = accepted.tolist(), d.tolist()
    out, i = [], 0
    for b, k in enumerate(num_draft):
        emitted = []
        for j in range(k):
            if not accepted[i + j]:
                emitted.append(tokens[starts[b] + j])
                break
            emitted.append(d[i + j])
        else:
            emitted.append(tokens[starts[b] + k])
        out.append(emitted)
        i += k
    return out
    ### END SOLUTION


# %% tags=["check"]
ch09.check_batched_accept(batched_accept)
