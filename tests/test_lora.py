"""Multi-LoRA serving (chapter 16) against HF + PEFT: a random adapter's greedy tokens through the
engine equal the PEFT model's with that adapter (fp32, CPU); a mixed batch (several adapters and
rows with none) equals each request alone; prefix caching stays exact when two adapters share a
prompt, and never hands one adapter's blocks to another; bad adapters are refused by name.

The adapters are PEFT's own (get_peft_model + save_pretrained) with random A and B (PEFT starts B
at zero, which would make every adapter the base model)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from lora_utils import make_adapter, peft_greedy
from tiny_models import make_tiny

from minillm import LLM, SamplingParams
from minillm.lora.request import LoRARequest

pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig fields): every module; attention only with rsLoRA and a rank below the max; the MLP
ADAPTERS = {"all": dict(r=8, lora_alpha=16, target_modules=ALL),
            "attn": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
            "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny("llama3", root / "base")
    rng = random.Random(16)
    prompts = [[rng.randrange(320) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    prompts.append(prompts[0][:30] + [1, 2, 3])  # shares two blocks with prompts[0]
    requests, oracle = {None: None}, {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        model = make_adapter(base, root / name, seed, **fields)
        requests[name] = LoRARequest(name, IDS[name], str(root / name))
        oracle[name] = [peft_greedy(model, p) for p in prompts]
        if name == "all":
            with model.disable_adapter():
                oracle[None] = [peft_greedy(model, p) for p in prompts]
    return dict(root=root, base=base, prompts=prompts, requests=requests, oracle=oracle)


def run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(setup):
    # two GPU slots and two CPU copies for three adapters: slots are swapped and the CPU pool evicts
    return LLM(str(setup["base"]), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)


def test_each_adapter_alone_equals_peft(setup, llm):
    prompts, oracle = setup["prompts"], setup["oracle"]
    for name, req in setup["requests"].items():
        for i, p in enumerate(prompts):
            assert run(llm, [p], req) == [oracle[name][i]], (name, i)
    text = "".join(llm.stream({"prompt_token_ids": prompts[1]}, GREEDY, lora_request=setup["requests"]["mlp"]))
    assert text == llm.tokenizer.decode(oracle["mlp"][1])
    for name in ADAPTERS:  # the adapters do change the answers (else the test could not fail)
        assert oracle[name] != oracle[None], name


def test_mixed_batch_equals_alone(setup, llm):
    prompts, oracle, reqs = setup["prompts"], setup["oracle"], setup["requests"]
    names = ["all", "attn", None, "mlp", "all", None, "attn", "mlp", None]
    batch = [prompts[i % len(prompts)] for i in range(len(names))]
    seen = []
    prepare = llm.engine.lora.prepare

    def spy(ids):
        seen.append(len({i for i in ids if i}))
        return prepare(ids)

    llm.engine.lora.prepare = spy
    try:
        got = run(llm, batch, [reqs[n] for n in names])
    finally:
        del llm.engine.lora.prepare
    assert got == [oracle[n][i % len(prompts)] for i, n in enumerate(names)]
    assert max(seen) == 2  # both slots used at once, never a third adapter in a step


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_prefix_cache_is_keyed_by_adapter(setup, kind):
    prompts, oracle, reqs = setup["prompts"], setup["oracle"], setup["requests"]
    llm = LLM(str(setup["base"]), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              enable_prefix_caching=kind)
    stats = llm.engine.engine_stats
    # prompts[4] shares its first two blocks with prompts[0], computed here under "all" only
    assert run(llm, [prompts[0]], reqs["all"]) == [oracle["all"][0]]
    for name, hit in (("attn", False), (None, False), ("all", True), ("attn", True)):
        before = stats.prefix_hit_tokens
        assert run(llm, [prompts[4]], reqs[name]) == [oracle[name][4]], name
        assert (stats.prefix_hit_tokens > before) == hit, (name, stats.prefix_hit_tokens - before)
    # two adapters sharing a prompt in one batch, with the cache warm for one of them: still exact
    assert run(llm, [prompts[4], prompts[4], prompts[0]], [reqs["mlp"], reqs["attn"], reqs["mlp"]]) == \
        [oracle["mlp"][4], oracle["attn"][4], oracle["mlp"][0]]


def test_padded_graph_path_reads_the_slot_buffer(setup):
    """The CUDA-graph path's static buffers (captured eagerly on a CPU: capture=False), mixed adapters."""
    prompts, oracle, reqs = setup["prompts"], setup["oracle"], setup["requests"]
    llm = LLM(str(setup["base"]), device="cpu", enable_lora=True, max_loras=3, max_lora_rank=8)
    runner = llm.engine.runner
    runner.graphs = runner.make_graphs(capture=False)
    names = ["mlp", None, "all", "attn"]
    assert run(llm, prompts[:4], [reqs[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    assert sum(runner.graphs.replays.values()) > 0


def test_slots_swap_lru(setup):
    prompts, oracle, reqs = setup["prompts"], setup["oracle"], setup["requests"]
    llm = LLM(str(setup["base"]), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=3)
    lora = llm.engine.lora
    for n in ("all", "attn", "all", "mlp"):
        assert run(llm, [prompts[1]], reqs[n]) == [oracle[n][1]], n
    assert lora.num_slot_loads == 4 and lora.num_disk_loads == 3  # the CPU pool kept all three
    # one slot, three adapters in one call: they take turns (waiting), each still exact
    names = ["mlp", "attn", "all", None, "attn"]
    assert run(llm, prompts[:5], [reqs[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]


def write_bad(setup, name: str, edit_config=None, tensors=None):
    """A copy of adapter "all" with its config edited, or other tensors."""
    from safetensors.torch import load_file, save_file

    src, dst = setup["root"] / "all", setup["root"] / name
    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return str(dst)


def test_bad_adapters_are_refused_by_name(setup, llm, tmp_path):
    def req(path, i=9, name="bad"):
        return LoRARequest(name, i, path)

    p = {"prompt_token_ids": setup["prompts"][0]}
    cases = [
        (req(str(tmp_path / "missing")), "is not a folder"),
        (req(write_bad(setup, "r16", lambda c: c.update(r=16))), r"rank r=16 is above max_lora_rank=8"),
        (req(write_bad(setup, "lm_head", lambda c: c.update(target_modules=["q_proj", "lm_head"]))),
         r"target module 'lm_head' is not supported"),
        (req(write_bad(setup, "embed", tensors=lambda w: {**w, "base_model.model.model.embed_tokens.lora_A.weight":
                                                          torch.zeros(8, 320)})),
         r"target module 'model.embed_tokens' is not supported"),
        (req(write_bad(setup, "other-model", tensors=lambda w: {k: torch.zeros(v.shape[0], 2 * v.shape[1])
                                                                if "q_proj.lora_A" in k else v
                                                                for k, v in w.items()})),
         r"does not fit the base model: .*q_proj.lora_A has shape \(8, 128\), this model .* wants \(8, 64\)"),
        (req(write_bad(setup, "deep-layer", tensors=lambda w: {
            **w, "base_model.model.model.layers.7.mlp.down_proj.lora_A.weight": torch.zeros(8, 112),
            "base_model.model.model.layers.7.mlp.down_proj.lora_B.weight": torch.zeros(64, 8)})),
         r"has 'model.layers.7.mlp.down_proj', which this model lacks"),
        (req(write_bad(setup, "dora", lambda c: c.update(use_dora=True))), "use_dora=True is not supported"),
        (req(setup["requests"]["attn"].lora_path, i=IDS["all"], name="all"), "lora_int_id 1 already names"),
    ]
    for lora, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request="all")
    with pytest.raises(ValueError, match="got 2 lora_request for 1 prompts"):
        llm.generate(p, GREEDY, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/x")
    # the engine still serves after every refusal
    assert run(llm, [setup["prompts"][0]], setup["requests"]["all"]) == [setup["oracle"]["all"][0]]


def test_engine_arguments_checked(setup):
    base = str(setup["base"])
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LLM(base, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive int"):
        LLM(base, device="cpu", enable_lora=True, max_lora_rank=0)
    with pytest.raises(TypeError, match="enable_lora must be True or False"):
        LLM(base, device="cpu", enable_lora="yes")
    plain = LLM(base, device="cpu")
    with pytest.raises(ValueError, match="built without LoRA: build it with enable_lora=True"):
        plain.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False, lora_request=setup["requests"]["all"])


@pytest.mark.parametrize("engine_args", [
    dict(async_scheduling=True),  # overlap scheduling: the next step's slots are prepared while one runs
    dict(max_num_batched_tokens=16, num_gpu_blocks=8, preemption_mode="swap"),  # chunked prefill, preemption
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                             "prompt_lookup_max": 2}),
    dict(max_num_batched_tokens=16, num_gpu_blocks=8),  # preemption by recompute
])
def test_mixed_batch_on_every_engine_path(setup, engine_args):
    prompts, oracle, reqs = setup["prompts"], setup["oracle"], setup["requests"]
    llm = LLM(str(setup["base"]), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, **engine_args)
    names = ["attn", None, "all", "mlp", "attn"]
    assert run(llm, prompts, [reqs[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    if "num_gpu_blocks" in engine_args:
        assert llm.engine.engine_stats.num_preemptions > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels, CUDA graphs)")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_mixed_batch_on_gpu_with_and_without_cuda_graphs(setup, enforce_eager):
    """The Triton shrink/expand kernels inside captured graphs (decode sizes and token buckets), fp32
    (bf16 would let batch shapes pick other GEMMs, flipping near-ties): PEFT's tokens, each request's."""
    prompts, oracle, reqs = setup["prompts"], setup["oracle"], setup["requests"]
    llm = LLM(str(setup["base"]), device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              enforce_eager=enforce_eager, cuda_graph_max_batch=8, max_num_batched_tokens=64)
    llm.engine.warm_up()
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        graphs.replays.clear()
    names = ["attn", None, "all", "mlp", "attn", "all", None, "mlp"]
    batch = [prompts[i % len(prompts)] for i in range(len(names))]
    assert run(llm, batch, [reqs[n] for n in names]) == [oracle[n][i % len(prompts)] for i, n in enumerate(names)]
    if graphs is not None:  # both kinds replayed: decode batches and steps with prompt tokens
        assert {s.max_seqlen == 1 for s in graphs.replays} == {True, False}


def test_a_passed_over_adapter_is_not_starved(setup):
    """One slot: while adapter "all" runs, a request for "attn" waits; a later "all" request must not
    overtake it (that could go on forever); a request with no adapter may."""
    prompts, reqs = setup["prompts"], setup["requests"]
    llm = LLM(str(setup["base"]), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.engine
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for rid, name in (("a1", "all"), ("x", "attn"), ("a2", "all"), ("base", None)):
        engine.add_request(rid, {"prompt_token_ids": prompts[1]}, long, lora_request=reqs[name])
    started = {}
    while engine.has_unfinished_requests():
        engine.step()
        for rid, group in list(engine.groups.items()):
            if group.metrics.first_scheduled_time is not None:
                started.setdefault(rid, len(started))
    assert started["a1"] == 0 and started["base"] == 1 and started["x"] < started["a2"]
