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
# # Lab 01 · Byte-pair encoding
#
# Build the heart of a BPE tokenizer: the pair count and the merge step that training repeats, and
# the encoder that replays SmolLM2's 48,900 merges on new text. Each check runs your function
# against minillm's tokenizer on fresh random inputs.

# %%
from minillm.labs import ch01
from minillm.tokenizer import load_tokenizer

tok = load_tokenizer()  # SmolLM2's tokenizer: for its merges and its pre-tokenizer


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch01.hint("count_pairs", 1)`, then 2, then 3. This lists the exercises:

# %%
ch01.hint()

# %% [markdown]
# ## Exercise 1 — counting pairs
#
# Training keeps the text as distinct chunks with their frequencies:
# `words = {(104, 105): 3, (104, 105, 33): 1}` means "hi" three times and "hi!" once (as byte ids).
# Return a `collections.Counter` mapping every adjacent pair of ids to how often it occurs overall —
# here `{(104, 105): 4, (105, 33): 1}`.

# %%
from collections import Counter


def count_pairs(words):
    ### BEGIN SOLUTION
    counts = Counter()
    for ids, freq in words.items():
        for pair in zip(ids, ids[1:]):
            counts[pair] += freq
    return counts
    ### END SOLUTION


# %% tags=["check"]
ch01.check_count_pairs(count_pairs)

# %% [markdown]
# ## Exercise 2 — the merge step
#
# Replace every occurrence of `pair` in `ids` with `new_id`, scanning left to right; a matched pair
# is consumed whole, so `merge_pair([5, 5, 5], (5, 5), 9) == [9, 5]`.

# %%
def merge_pair(ids, pair, new_id):
    ### BEGIN SOLUTION
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
    ### END SOLUTION


# %% tags=["check"]
ch01.check_merge_pair(merge_pair)

# %% [markdown]
# ## Exercise 3 — the encoder loop
#
# `merges` maps a pair of ids to `(rank, merged_id)`; rank is the order training learned it in.
# Starting from one id per byte, repeatedly merge the adjacent pair with the **lowest rank** (all its
# occurrences, with your `merge_pair`) until no adjacent pair is in `merges`.

# %%
def bpe(ids, merges):
    ### BEGIN SOLUTION
    while len(ids) >= 2:
        ranked = [(merges[p][0], p) for p in zip(ids, ids[1:]) if p in merges]
        if not ranked:
            break
        _, pair = min(ranked)
        ids = merge_pair(ids, pair, merges[pair][1])
    return ids
    ### END SOLUTION


# %% tags=["check"]
ch01.check_bpe(bpe)

# %% [markdown]
# ## Exercise 4 — the whole encoder
#
# Put it together for text without added tokens: cut the text with `tok.pre_tokenizer.split(text)`,
# turn each chunk's UTF-8 bytes into one id per byte with `tok.bytes_to_ids(chunk.encode())`, run your `bpe`
# with `tok.merges`, and concatenate.

# %%
def encode(text):
    ### BEGIN SOLUTION
    ids = []
    for chunk in tok.pre_tokenizer.split(text):
        ids += bpe(tok.bytes_to_ids(chunk.encode("utf-8")), tok.merges)
    return ids
    ### END SOLUTION


# %% tags=["check"]
ch01.check_encode(encode)

# %% [markdown]
# Your encoder now cuts text exactly like SmolLM2's tokenizer (and so like HF's). How much slower is
# it than `tok.encode`, which caches chunks it has seen? Time both on a paragraph to find out.
