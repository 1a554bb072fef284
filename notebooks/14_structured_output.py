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
# # 14 · Structured output: a grammar, masked at the token level
#
# A request with `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` must come back
# as JSON that validates. The engine does not hope for it: at every step it computes which tokens of the
# 49,152-token vocabulary may come next under the grammar, and sets every other logit to $-\infty$
# before anything samples. This notebook opens that machine: a regex compiled to a DFA and aligned with
# the vocabulary (the token index), a JSON Schema compiled to a pushdown automaton, the masks checked
# against a brute-force walk and against xgrammar, the engine's outputs checked by `jsonschema`, and then
# `minillm bench structured`: compile and mask time against xgrammar, and constrained decoding against
# free decoding in the engine.

# %%
import json
import os
import random
import re
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    torch.set_num_threads(1)  # a CPU run uses tiny shapes, where more threads only wait on each other

import jsonschema
import matplotlib.pyplot as plt

from minillm import SamplingParams
from minillm import notebook as nb
from minillm.bench import structured
from minillm.bench.table import print_table
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.loader import load_model
from minillm.structured_output import GrammarCompiler, Matcher, StructuredOutputsParams, TokenVocab
from minillm.structured_output.peer import PARITY_SCHEMAS, compile_both, parity_walk
from minillm.structured_output.token_index import unpack_bits

nb.header("14")
dev = nb.device()
T0 = time.perf_counter()

# %% [markdown]
# ## 1. A regex meets the vocabulary
#
# The grammar's automaton reads **bytes**; the model emits **tokens**, each a few bytes that pay no
# attention to the grammar's pieces. The token index answers, for each automaton state, which tokens
# can be read from there to their last byte without falling off (Willard & Louf's index, Outlines).
# Below: a phone-number regex, its minimal DFA, and the tokens allowed in a few states. A token such
# as `'-'` is allowed only after three digits; one that starts with a digit and goes on with a letter
# never is.

# %%
model, cfg, tok = load_model(None, dtype=torch.bfloat16 if nb.on_gpu() else torch.float32, device=dev)
vocab = TokenVocab.from_tokenizer(tok)
compiler = GrammarCompiler(vocab)
phone = compiler.compile(StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"))
dfa = phone.pda.dfas["$root"]


def allowed(matcher: Matcher) -> np.ndarray:
    return matcher.allowed_tokens()


m = Matcher(phone)
for text in ["", "(", "(555", "(555) 12", "(555) 123", "(555) 123-4567"]:
    m.reset()
    assert m.accept_string(text)
    ids = allowed(m)
    shown = [tok.vocab[t] if t not in vocab.stop_ids else b"<EOS>" for t in ids[:6]]
    print(f"after {text!r:18} {len(ids):5} tokens allowed, e.g. {shown}")

# %% [markdown]
# The oracle is the definition: walk every token's bytes through the DFA, for every state. The engine
# builds all rows at once with numpy (`token_index.py`), this cell with a plain loop.

# %%
# NBVAL_CHECK_OUTPUT
def brute_force_row(state: int) -> set[int]:
    ok = set()
    for t, data in enumerate(vocab.token_bytes):
        s = state
        for b in data:
            s = dfa.trans[s, b]
            if s < 0:
                break
        if data and s >= 0:
            ok.add(t)
    return ok | (set(vocab.stop_ids) if dfa.final[state] else set())


for state in range(dfa.num_states):
    mask = phone.mask_for(frozenset({phone.pda.stack(-1, state)}))
    assert set(np.nonzero(unpack_bits(mask, vocab.vocab_size))[0].tolist()) == brute_force_row(state), state
print(f"{dfa.num_states} DFA states: every row of the token index equals the brute-force walk of "
      f"{vocab.vocab_size} tokens")

# %% [markdown]
# ## 2. JSON: a pushdown automaton, and which tokens need the stack
#
# A JSON Schema is compiled to a grammar, and recursion (values inside arrays inside values) is what a
# finite automaton cannot count: those rules stay rules, and the automaton keeps a **stack** of return
# states. Most tokens are decided inside one rule at compile time (XGrammar's *context-independent*
# tokens); a few — a token like `"},` that closes a string and goes on in whoever called it — depend on
# the stack and are walked at run time (*context-dependent*). Below, for the parity set's schemas: the
# automaton's size, how many (node, token) pairs needed the exact walk, and how many stayed
# context-dependent. Then a random walk through each grammar with xgrammar's matcher beside ours: the
# allowed sets must be equal at every step.

# %%
rows, steps = [], nb.pick(cpu=40, gpu=400)
for name in ("person", "nested", "tree", "json_object"):
    ours, theirs, our_ms, their_ms = compile_both(vocab, "json", PARITY_SCHEMAS[name])
    w = parity_walk(ours, theirs, steps, random.Random(14))
    assert not w.mismatches, (name, w.mismatches[:1])
    for text in w.finished:
        jsonschema.validate(json.loads(text.decode("utf-8", "surrogatepass"), strict=False), PARITY_SCHEMAS[name])
    ctx_dep = sum(len(x) for x in ours.index.mid)
    rows.append({"schema": name, "nodes": ours.num_nodes, "exact walks": ours.index.num_python_walks,
                 "context-dependent": ctx_dep, "of (node, token)": ours.num_nodes * vocab.vocab_size,
                 "steps equal": w.steps, "outputs valid": len(w.finished)})
print_table(rows, title=f"JSON schemas against xgrammar, {steps} random-walk steps each")

# %% [markdown]
# ## 3. Through the engine
#
# The engine compiles a request's grammar when it accepts the request (cached by the spec's hash), gives
# each sequence a matcher, fills one bitmask row per constrained sequence each step, and the worker
# applies it at its one mask point before greedy, seeded sampling or the rejection sampler look at the
# logits. The embedded SmolLM2-135M answers a JSON Schema, a regex and a choice; every answer is checked.

# %%
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "number"}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}
asks = [("json", schema, "Give the capital of France as JSON with city, country and population_millions."),
        ("regex", r"[A-Z][a-z]+ is the capital of [A-Z][a-z]+\.", "What is the capital of Italy?"),
        ("choice", ["Paris", "London", "Rome"], "Which city is the capital of England?")]
engine = LLMEngine(model, tok, cfg.eos_token_ids or [tok.eos_token_id], EngineConfig(num_gpu_blocks=nb.pick(cpu=64, gpu=512)),
                   progress=False)
for i, (kind, spec, q) in enumerate(asks):
    engine.add_request(f"r{i}", {"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}],
                                                                            tokenize=True)},
                       SamplingParams(max_tokens=nb.pick(cpu=40, gpu=80), temperature=0,
                                      structured_outputs=StructuredOutputsParams(**{kind: spec})))
outs = {}
while engine.has_unfinished_requests():
    outs |= {o.request_id: o.outputs[0] for o in engine.step(unfinished_outputs=False)}
for i, (kind, spec, _) in enumerate(asks):
    out = outs[f"r{i}"]
    print(f"{kind:7} {out.finish_reason:7} {out.text}")
    if out.finish_reason == "stop":
        if kind == "json":
            jsonschema.validate(json.loads(out.text), spec)
        elif kind == "regex":
            assert re.fullmatch(spec, out.text)
        else:
            assert out.text in spec
engine.shutdown()
del engine

# %% [markdown]
# **Jump-forward.** After `{"city": "Paris", ` the schema leaves one thing to write: `"country": "`. A
# matcher can say so (`forced_bytes`): the grammar allows one byte at a time until the string's body.
# SGLang's jump-forward decoding appends such runs without a forward pass each (retokenizing at the
# boundary). minillm does **not** implement it; the benchmark below counts, on real outputs, how many
# steps it could have skipped.

# %%
m = Matcher(compiler.compile(StructuredOutputsParams(json=schema)))
assert m.accept_string('{"city": "Paris", ')
print(repr(m.forced_bytes()))

# %% [markdown]
# ## 4. The benchmark: `minillm bench structured`
#
# Everything below comes from one call, the same as `minillm bench structured --json out.json`: on a GPU
# the full set with the embedded SmolLM2; on a CPU the `--quick` sizes (one grammar of each kind, short
# walks, batch 1 and 4, 8 new tokens) with a tiny random model over the real vocabulary. Compile
# cold is a fresh compiler; cached is the same spec again. Mask time is one bitmask fill along a
# random walk, xgrammar's and ours filled at every step (which goes first alternates between repeats)
# and compared. Decode puts the constrained requests (batch 1: the one; batch 64: half) in the
# engine next to free ones, all asking for a JSON list of records.

# %%
del model
if nb.on_gpu():  # the embedded SmolLM2, the full set
    res = structured.run(None, quick=False, repeats=3, json_path=os.environ.get("MINILLM_BENCH_JSON"))
else:  # a CPU only shows the code runs: a tiny random Llama over SmolLM2's real vocabulary, quick sizes
    tiny = ModelConfig(architecture="llama", vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512,
                       tie_word_embeddings=True, name="tiny-llama (random)", eos_token_ids=[tok.eos_token_id])
    res = structured.run(tiny, tokenizer=tok, quick=True, repeats=3, block_size=8, num_gpu_blocks=256)

# %%
g = res["grammars"]
fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
x = np.arange(len(g))
axes[0].bar(x - 0.2, [r["ours_p50_us"] for r in g], 0.4, label="minillm p50")
axes[0].bar(x + 0.2, [r["xgr_p50_us"] for r in g], 0.4, label="xgrammar p50")
axes[0].scatter(x - 0.2, [r["ours_p99_us"] for r in g], marker="_", s=120, color="C0", label="minillm p99")
axes[0].scatter(x + 0.2, [r["xgr_p99_us"] for r in g], marker="_", s=120, color="C1", label="xgrammar p99")
axes[0].set_xticks(x, [r["grammar"][:22] for r in g], rotation=70, ha="right", fontsize=8)
axes[0].set(yscale="log", ylabel="µs per bitmask fill", title="mask time along random walks")
axes[0].legend(fontsize=8)
axes[0].grid(True, axis="y", alpha=0.3)
d = res["decode"]
batches = sorted({r["batch"] for r in d})
for j, mode in enumerate(("free", "constrained")):
    vals = [[r["full_batch_tok_s"] for r in d if r["batch"] == b and r["mode"] == mode] for b in batches]
    med = [float(np.median(v)) for v in vals]
    err = [[m_ - min(v) for m_, v in zip(med, vals)], [max(v) - m_ for m_, v in zip(med, vals)]]
    axes[1].bar(np.arange(len(batches)) + (j - 0.5) * 0.4, med, 0.4, yerr=err, capsize=4, label=mode)
axes[1].set_xticks(np.arange(len(batches)), [f"batch {b}" for b in batches])
axes[1].set(ylabel="decode tok/s (median, min-max)", title="constrained vs free decode")
axes[1].legend()
axes[1].grid(True, axis="y", alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Overhead accounting: the mask against the step
#
# A constrained step pays, on the host, the bitmask fill and the matcher's advance for each constrained
# sequence (`grammar_ms`), and, on the device, the mask's upload and application (`apply` below: the
# plain-PyTorch reference, and the Triton kernel the worker runs on a GPU). With overlap scheduling on (a
# GPU's default) constrained steps stay overlapped: the engine queues a step's forward pass first, then
# fills its mask from the previous step's tokens while the GPU runs it
# (`chapters/bench/structured-overlap-design.md`; `scripts/gpu/structured_ablation.py` splits the rest).

# %%
s = res["summary"]
print_table([{"batch": r["batch"], "mode": r["mode"], "step_ms": r["step_ms"], "grammar_ms": r["grammar_ms"],
              "grammar % of step": 100 * r["grammar_ms"] / r["step_ms"], "tok/s": r["full_batch_tok_s"]}
             for r in d if r["repeat"] == 0], title="decode steps while the whole batch runs (repeat 0)")
print_table(res["apply"], title="applying the bitmask, ms per step")
print_table([{"figure": k, "median": v["median"], "min": v["min"], "max": v["max"]}
             for k, v in s.items() if isinstance(v, dict)], title="headline: median of 3 repeats, min-max")
v = res["validity"]
print(f"validity: {v['outputs']} outputs of {v['cases']} schemas/regexes, {v['finished_pct']:.0f} % finished, "
      f"{v['valid_pct_of_finished']:.0f} % of those valid; jump-forward could have skipped "
      f"{v['jump_forward_steps_pct']:.1f} % of {v['output_tokens']} steps")
assert s["all_masks_equal"] and v["valid_pct_of_finished"] == 100.0, v["invalid"]
print(f"notebook: {time.perf_counter() - T0:.0f} s")
