# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 17 · The router's two-phase request
#
# `minillm router` stands in front of two engines: a producer that only prefills and a consumer that
# only decodes. For every request it asks twice. Here you write those two asks, over two `LLMEngine`s
# in this process that share a KV connector (`SharedStorageConnector`: the producer writes each layer's
# K/V to files as it computes them; the consumer reads them back layer by layer). The check runs your
# function on fresh random prompts and compares the consumer's tokens with a colocated engine's.

# %%
import dataclasses

from minillm.labs import ch17

# %% [markdown]
# Stuck? The exercise has three hints, from a nudge to a near-solution: run `ch17.hint("two_phase", 1)`,
# then 2, then 3. This lists the exercises:

# %%
ch17.hint()

# %% [markdown]
# ## Exercise — `two_phase`
#
# `two_phase(producer, consumer, request_id, prompt_ids, params)` returns the token ids the client
# should get for `prompt_ids` under `params` (a `SamplingParams`), computed the disaggregated way:
#
# 1. **Phase 1, on the producer:** the same prompt with `max_tokens=1` and the handle
#    `extra_args={"kv_transfer_params": {"do_remote_decode": True, "transfer_id": ID}}`. The producer
#    computes the prompt's K/V, saves them through its connector and generates one token, which is
#    thrown away.
# 2. **Phase 2, on the consumer:** the client's own `params` with
#    `{"do_remote_prefill": True, "transfer_id": ID}`, the *same* ID. The consumer finds the K/V, loads
#    them instead of computing them, computes only the prompt's last token and decodes.
#
# `ch17.finish(engine, request_id, prompt_ids, params)` adds one request to an engine, steps it until
# that request has finished and returns its token ids. `dataclasses.replace(params, ...)` gives a
# changed copy of a `SamplingParams`. The check also fails if the consumer computed the whole prompt
# (then nothing came from the producer) or if the producer generated more than one token.

# %%
def two_phase(producer, consumer, request_id, prompt_ids, params):
    ### BEGIN SOLUTION
    tid = f"lab-{request_id}"
    first = dataclasses.replace(params, max_tokens=1,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}})
    ch17.finish(producer, request_id, prompt_ids, first)
    second = dataclasses.replace(params, extra_args={"kv_transfer_params": {"do_remote_prefill": True,
                                                                            "transfer_id": tid}})
    return ch17.finish(consumer, request_id, prompt_ids, second)
    ### END SOLUTION


# %% tags=["check"]
ch17.check_two_phase(two_phase)

# %% [markdown]
# **Going further.** The router does this over HTTP (`minillm/entrypoints/router.py`): phase 1 without
# streaming, phase 2's answer relayed byte for byte. What should it do when the client goes away between
# the two phases? When the consumer dies mid-answer? (Chapter 17, "Faults".)
