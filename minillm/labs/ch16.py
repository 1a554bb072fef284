"""Checks for lab 16: the BGMV update and the LoRA scaling, run inside the engine against PEFT.

Exercise 1 (bgmv): y [T, out] += (x[t] . A[slot[t]]^T) . B[slot[t]]^T per token t and stacked part,
in place, slot -1 untouched; the signature of kernels/lora_bgmv.py's add_lora_ref. First against
add_lora_ref on fresh random inputs (1 to 3 parts at random offsets, a mix of slots and -1s); then the
student's function replaces the LoRA layers' update (lora/layers.py) and a tiny random Llama serves
one mixed batch (random PEFT adapters, rows without one): every token the engine chose must be HF +
PEFT's greedy choice with that adapter alone, given the tokens before it (fp32, CPU; a tie within
rounding counts, as a tiny random model has near-ties that fp32 order of operations may flip).

Exercise 2 (lora_scaling): the factor on B A, alpha / r or alpha / sqrt(r) with rsLoRA; against
minillm's on random ranks and alphas, then inside the adapter loader (lora/adapter.py) with a plain
and an rsLoRA adapter in one batch, against PEFT.
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from unittest import mock

import torch

from ..kernels.lora_bgmv import add_lora_ref
from .checker import PASSED, CheckFailed, Verdict, check
from .hints import Hints

_CACHE: dict = {}
VOCAB, GREEDY_TOKENS = 128, 6


def _base():
    """A tiny random HF Llama (large weights: clear winners among the logits), saved once; -> its folder."""
    if "base" not in _CACHE:
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(cfg)
        g = torch.Generator().manual_seed(16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                norm = "norm" in name
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
        folder = Path(tempfile.mkdtemp(prefix="minillm-lab16-")) / "base"
        model.save_pretrained(folder)
        _CACHE["base"] = folder
    return _CACHE["base"]


def _hf():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(_base()), dtype=torch.float32).eval()


def _engine(max_loras: int, rank: int):
    from ..bench.serving_setup import NoTextTokenizer
    from ..engine import EngineConfig, LLMEngine
    from ..loader import load_model

    model, _, _ = load_model(str(_base()), dtype=torch.float32, device=torch.device("cpu"), tokenizer=False)
    return LLMEngine(model, NoTextTokenizer(), [], EngineConfig(enable_lora=True, max_loras=max_loras,
                                                                 max_lora_rank=rank, block_size=8,
                                                                 num_gpu_blocks=64), progress=False)


def _serve(engine, prompts, loras) -> list[list[int]]:
    from ..sampling import SamplingParams

    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (p, lr) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params, lora_request=lr)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished}
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _peft_case(seed: int, configs: list[dict]):
    """Fresh random PEFT adapters (one per LoraConfig fields) on the tiny model, and a shuffled batch of
    prompts naming them (and none): -> (the PeftModel, requests, prompts, names)."""
    import peft

    from ..lora import LoRARequest

    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="minillm-lab16-a-"))
    model, reqs = None, []
    for i, fields in enumerate(configs):
        name = f"a{i}"
        cfg = peft.LoraConfig(**fields)
        model = peft.get_peft_model(_hf(), cfg, adapter_name=name) if model is None else model
        if name not in model.peft_config:
            model.add_adapter(name, cfg)
        g = torch.Generator().manual_seed(seed * 31 + i)
        with torch.no_grad():
            for pname, w in model.named_parameters():
                if f".{name}." in pname and "lora_" in pname:
                    w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        model.save_pretrained(str(root), selected_adapters=[name])
        folder = root / name if (root / name / "adapter_config.json").exists() else root
        reqs.append(LoRARequest(name, i + 1, str(folder)))
    names = [None] + [f"a{i}" for i in range(len(configs))] * 2
    rng.shuffle(names)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in names]
    by_name = {r.lora_name: r for r in reqs}
    return model.eval(), [by_name.get(n) for n in names], prompts, names


@torch.inference_mode()
def _compare(what: str, model, prompts, names, got) -> None:
    """Each request's tokens must be HF + PEFT's greedy choices with that adapter alone: at every step the
    token we chose has PEFT's top logit, given the tokens before it (a tie within fp32 rounding counts)."""
    for i, (p, n, g) in enumerate(zip(prompts, names, got)):
        ids = torch.tensor([p + g[:-1]])  # [1, P + n - 1]: teacher-forced on our own tokens
        if n is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits[0, len(p) - 1 :]  # [n, V]
        else:
            model.set_adapter(n)
            logits = model(input_ids=ids).logits[0, len(p) - 1 :]
        best = logits.max(dim=-1).values  # [n]
        ours = logits[torch.arange(len(g)), torch.tensor(g)]  # [n]
        bad = (ours < best - 1e-4 * (1 + best.abs())).nonzero()
        if len(bad):
            j = int(bad[0])
            raise CheckFailed(f"❌ {what}: inside the engine, request {i} (adapter {n or 'none'}) chose token {g[j]} "
                              f"at step {j}, but HF + PEFT with that adapter alone would choose "
                              f"{int(logits[j].argmax())} (logit {float(best[j]):.4f} vs {float(ours[j]):.4f})")


# ---- exercise 1: bgmv ---------------------------------------------------------------------------------

def _bgmv_case(rng: random.Random):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T, L, R, K = rng.randint(1, 12), rng.randint(1, 4), rng.choice([1, 2, 4, 8]), rng.randint(3, 40)
    S = rng.randint(1, 3)
    sizes = [rng.randint(1, 24) for _ in range(S)]
    offsets = tuple(sum(sizes[:i]) for i in range(S))
    slots = torch.tensor([rng.randrange(-1, L) for _ in range(T)], dtype=torch.int64 if rng.random() < 0.5 else torch.int32)
    x = torch.randn(T, K, generator=g)
    a = torch.randn(L, S * R, K, generator=g)
    b = torch.randn(L, sum(sizes), R, generator=g)
    y = torch.randn(T, sum(sizes), generator=g)
    return y, x, a, b, slots, offsets


def _close(got, want) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def check_bgmv(fn, cases: int = 40, engine_cases: int = 1):
    def run(impl):
        def go(y, x, a, b, slots, offsets):
            out = y.clone()
            impl(out, x, a, b, slots, offsets)  # in place
            return out
        return go

    check("bgmv on random inputs", run(fn), run(add_lora_ref), _bgmv_case, cases=cases, equal=_close)
    from ..lora import layers

    ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for _ in range(engine_cases):
        seed = random.SystemRandom().randrange(1 << 20)
        configs = [dict(r=4, lora_alpha=8, target_modules=ALL), dict(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"]),
                   dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])]
        model, reqs, prompts, names = _peft_case(seed, configs)
        engine = _engine(max_loras=3, rank=4)
        with mock.patch.object(layers, "add_lora", fn), mock.patch.object(layers, "add_lora_ref", fn):
            got = _serve(engine, prompts, reqs)
        engine.shutdown()
        _compare("bgmv", model, prompts, names, got)
    print(f"✅ bgmv inside the engine: {engine_cases} mixed batch(es) of {len(names)} requests (3 adapters and none) "
          "equal HF + PEFT")
    return Verdict("bgmv", PASSED, cases + engine_cases)


# ---- exercise 2: lora_scaling -------------------------------------------------------------------------

def _scaling_ref(r, alpha, rs):
    return alpha / math.sqrt(r) if rs else alpha / r


def check_lora_scaling(fn, cases: int = 50):
    def make(rng):
        return rng.randint(1, 64), rng.choice([1, 8, 16, 32, rng.uniform(0.5, 64)]), rng.random() < 0.5

    check("lora_scaling", lambda r, a, rs: float(fn(r, a, rs)), _scaling_ref, make, cases=cases,
          equal=lambda got, want: abs(got - want) <= 1e-9 * max(1.0, abs(want)))
    from ..lora import adapter

    seed = random.SystemRandom().randrange(1 << 20)
    ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    configs = [dict(r=4, lora_alpha=16, target_modules=ALL), dict(r=4, lora_alpha=16, use_rslora=True, target_modules=ALL)]
    model, reqs, prompts, names = _peft_case(seed, configs)
    engine = _engine(max_loras=2, rank=4)
    with mock.patch.object(adapter, "lora_scaling", fn):
        got = _serve(engine, prompts, reqs)
    engine.shutdown()
    _compare("lora_scaling", model, prompts, names, got)
    print(f"✅ lora_scaling inside the engine: a plain and an rsLoRA adapter, {len(names)} requests, equal HF + PEFT")
    return Verdict("lora_scaling", PASSED, cases + 1)


hint = Hints("16", {
    "bgmv": (
        "Each token t reads its own adapter: slot = slots[t]. A token with slot -1 has none and stays as it was. "
        "The shrink x[t] @ A[slot].T gives S * R numbers: chunk i (R of them) belongs to part i.",
        "Part i owns y's columns slice_offsets[i] .. slice_offsets[i+1] (the last one to the end). Its update is "
        "chunk i of the shrink times B[slot, those columns].T. Careful: A[-1] is the LAST slot in Python, not "
        "'no adapter' - skip slot -1 explicitly (or mask it).",
        "R = b.shape[2]; ends = list(slice_offsets[1:]) + [y.shape[1]]\nfor t in range(y.shape[0]):\n"
        "    s = int(slots[t])\n    if s < 0: continue\n    h = x[t].float() @ a[s].float().T   # [S * R]\n"
        "    for i, (lo, hi) in enumerate(zip(slice_offsets, ends)):\n"
        "        y[t, lo:hi] += (h[i * R:(i + 1) * R] @ b[s, lo:hi].float().T).to(y.dtype)",
    ),
    "lora_scaling": (
        "PEFT multiplies B A by a constant that depends on the rank r and lora_alpha, and on whether the "
        "adapter uses rsLoRA.",
        "Plain LoRA: alpha / r. rsLoRA keeps the update's size steady as r grows: alpha / sqrt(r).",
        "return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r",
    ),
})
