"""Checks for lab 13: a fused residual-add + RMSNorm kernel, and the one-step-late finish rule.

Exercise 1 runs the student's Triton kernel (natively on a GPU, in Triton's interpreter on a CPU) on
fresh random rows of odd widths and compares it with minillm's own RMSNorm layer called the way every
decoder layer calls it, `norm(x, residual)` -> (normed, new residual).

Exercise 2 compares the student's rule with a real overlapped engine: a tiny random model, random
requests (greedy and seeded sampling, max_tokens, stop tokens taken from what each request would
generate), run through LLMEngine with async_scheduling=True; the check records every row the engine
sampled (its steps in flight) and which tokens each request kept.
"""

from __future__ import annotations

import os
import random
from typing import NamedTuple

import torch

from ..bench.serving_setup import NoTextTokenizer
from ..config import ModelConfig
from ..engine import EngineConfig, LLMEngine
from ..layers.layernorm import RMSNorm
from ..loader import load_model
from ..sampling import SamplingParams
from .checker import check
from .hints import Hints

# ---- exercise 1: fused residual add + RMSNorm ------------------------------------------------------


def launch_add_rms_norm(kernel, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Run kernel over x, residual [T, H] (contiguous) -> (out, new_residual), one program per row.

    The kernel's arguments: x, residual, weight, out, new_residual pointers, then H and eps, then BLOCK
    (a constexpr: the next power of two >= H)."""
    import triton

    T, H = x.shape
    out, new_res = torch.empty_like(x), torch.empty_like(x)
    kernel[(T,)](x, residual, weight, out, new_res, H, eps, BLOCK=triton.next_power_of_2(H))
    return out, new_res


def _triton_ready(name: str) -> bool:
    gpu = torch.cuda.is_available()
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{name}: no CUDA GPU: set TRITON_INTERPRET=1 before importing triton (the lab's first "
                           "cell does) so the kernel runs in Triton's CPU interpreter, then restart the kernel")
    print(f"running the kernel {'natively on the GPU' if gpu else 'in Triton' + chr(39) + 's CPU interpreter'}")
    return gpu


def check_add_rms_norm(kernel, cases: int | None = None):
    """kernel: the lab's @triton.jit fused residual-add + RMSNorm (see launch_add_rms_norm)."""
    gpu = _triton_ready("add_rms_norm")
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    cases = cases or (40 if gpu else 10)

    def case(rng: random.Random):
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        T, H = rng.randint(1, 9), rng.choice([1, 7, 33, 100, 129, 576, 1000])
        x = (torch.randn(T, H, generator=g) * rng.choice([0.1, 1.0, 8.0])).to(device, dtype)
        residual = torch.randn(T, H, generator=g).to(device, dtype)
        weight = (1 + 0.2 * torch.randn(H, generator=g)).to(device, dtype)
        return x, residual, weight, rng.choice([1e-5, 1e-6])

    def student(x, residual, weight, eps):
        return launch_add_rms_norm(kernel, x, residual, weight, eps)

    def reference(x, residual, weight, eps):
        norm = RMSNorm(x.shape[1], eps).to(device, dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            return norm(x, residual)  # (norm(x + residual), x + residual)

    tol = (2e-2, 1e-2) if gpu else (1e-5, 1e-5)  # bf16: an ulp of the rounded output; fp32: the sum's order

    def close(got, want):
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return False
        (out, new_res), (want_out, want_res) = got, want
        return (out.shape == want_out.shape and torch.equal(new_res, want_res)  # one rounded add, both ways
                and torch.allclose(out.float(), want_out.float(), atol=tol[0], rtol=tol[1]))

    return check("add_rms_norm", student, reference, case, cases=cases, equal=close)


# ---- exercise 2: the one-step-late finish rule ------------------------------------------------------


class Request(NamedTuple):
    """One request of the trace: the tokens it samples at output positions 0, 1, 2, ... (what it makes
    alone; batching and overlap never change them), and when it stops."""

    tokens: list[int]  # long enough: more than it can keep
    max_tokens: int
    stop_token_ids: list[int]


class _Case(tuple):
    def __repr__(self):
        (reqs,) = self
        return "[" + ", ".join(f"Request(tokens={r.tokens}, max_tokens={r.max_tokens}, "
                               f"stop_token_ids={r.stop_token_ids})" for r in reqs) + "]"


_MODEL = None


def _tiny_model():
    """A 2-layer random Llama with a 256-token vocabulary on the CPU (built once): its tokens only need to
    be deterministic, and a small vocabulary keeps every step cheap."""
    global _MODEL
    if _MODEL is None:
        cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256, name="lab13-random")
        model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(13)
        with torch.no_grad():
            for name, p in model.named_parameters():  # large weights: clear winners among the logits
                norm = "norm" in name
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
        _MODEL = model
    return _MODEL


def _engine(overlap: bool) -> LLMEngine:
    return LLMEngine(_tiny_model(), NoTextTokenizer(), [], EngineConfig(block_size=4, num_gpu_blocks=128,
                                                                        async_scheduling=overlap), progress=False)


def _streams(prompts, params, length: int) -> list[list[int]]:
    """Each request's first `length` tokens, with no stop: the plain engine, overlap off."""
    engine = _engine(False)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        free = SamplingParams(max_tokens=length, temperature=sp.temperature, seed=sp.seed, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, free)
    got = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return [got[f"r{i}"] for i in range(len(prompts))]


def _trace(rng: random.Random):
    vocab = _tiny_model().config.vocab_size
    n = rng.randint(1, 5)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30)) for _ in range(n)]
    length = 12
    streams = _streams(prompts, params, length)
    reqs = []
    for tokens in streams:
        max_tokens = rng.randint(1, length - 1)
        # stop tokens: some the request meets (before, at or just after max_tokens), some it never makes
        near = tokens[: max_tokens + 2]
        stops = rng.sample(near, rng.randint(0, min(2, len(near)))) + [rng.randrange(vocab)] * rng.randint(0, 1)
        reqs.append(Request(tokens, max_tokens, sorted(set(stops))))
    return _Case((reqs,)), prompts, params


def _overlapped(prompts, params, reqs) -> tuple[list[list[int]], list[int]]:
    """minillm's overlapped engine on these requests -> (tokens each keeps, rows sampled and thrown away)."""
    engine = _engine(True)
    rows = {}
    process = engine._process

    def counting(step):  # every row the GPU sampled, counted when the host processes its step
        for seq in step.seqs:
            rows[seq.seq_id] = rows.get(seq.seq_id, 0) + 1
        return process(step)

    engine._process = counting  # an instance attribute shadows the method
    ids = {}
    for i, (p, sp, r) in enumerate(zip(prompts, params, reqs)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(
            max_tokens=r.max_tokens, temperature=sp.temperature, seed=sp.seed, stop_token_ids=r.stop_token_ids))
        ids[f"r{i}"] = engine.groups[f"r{i}"].seqs[0].seq_id
    kept = {}
    while engine.has_unfinished_requests():
        kept |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    order = [f"r{i}" for i in range(len(reqs))]
    if [kept[r] for r in order] != [r.tokens[: len(kept[k])] for k, r in zip(order, reqs)]:
        raise RuntimeError("check: the overlapped engine's tokens are not the requests' streams")
    return [kept[r] for r in order], [rows.get(ids[r], 0) - len(kept[r]) for r in order]


class _OneThread:
    """Run the tiny model's steps on one CPU thread: at these sizes more threads only wait on each other
    (several times slower on a busy machine)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def check_finish_one_step_late(fn, cases: int = 20):
    """fn(requests: list[Request]) -> (kept, wasted): kept[i] the tokens request i keeps, wasted[i] how many
    of its sampled rows the engine computed and threw away."""
    last = {}  # the prompts and sampling parameters behind the case just made (the student sees the trace)

    def make(rng: random.Random):
        with _OneThread():
            c, last["prompts"], last["params"] = _trace(rng)
        return c

    def reference(reqs):
        with _OneThread():
            return _overlapped(last["prompts"], last["params"], reqs)

    def student(reqs):
        out = fn([Request(list(r.tokens), r.max_tokens, list(r.stop_token_ids)) for r in reqs])
        if not (isinstance(out, tuple) and len(out) == 2):
            return out
        kept, wasted = out
        return [[int(t) for t in k] for k in kept], [int(w) for w in wasted]

    return check("finish_one_step_late", student, reference, make, cases=cases)


hint = Hints("13", {
    "add_rms_norm": (
        'One program per row: load the whole row (BLOCK lanes, masked past H), add the residual, store it, then normalise.',
        'Add in fp32 and round to x\'s dtype: that rounded sum is the new residual AND what you normalise. mean(x^2) divides by H, not BLOCK (the masked lanes are 0). Round x * rsqrt(mean + eps) to x\'s dtype before multiplying by the weight, as the layer does.',
        'row = tl.program_id(0); cols = tl.arange(0, BLOCK); mask = cols < H\nx = tl.load(X + row * H + cols, mask=mask, other=0.0); r = tl.load(R + row * H + cols, mask=mask, other=0.0)\nx = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype); tl.store(NEW_RES + row * H + cols, x, mask=mask)\nxf = x.to(tl.float32); y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)).to(x.dtype)\nw = tl.load(W + cols, mask=mask, other=0.0); tl.store(OUT + row * H + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)',
    ),
    "finish_one_step_late": (
        'Batching and overlap never change which token a request samples at its j-th step, only when the host learns it. Work out, per request, which tokens it keeps, then whether the engine had already launched another step for it.',
        'A request keeps its tokens up to and including the first stop token, or its first max_tokens, whichever comes first. The host schedules step N+1 before it sees step N\'s token, so a stop token costs one more row, thrown away. But the host can count: when the token of step N is certainly the last (max_tokens reached), it gives the request no step N+1.',
        'for r in requests:\n    out = []\n    for t in r.tokens:\n        out.append(t)\n        if t in r.stop_token_ids or len(out) == r.max_tokens: break\n    kept.append(out); wasted.append(1 if len(out) < r.max_tokens else 0)',
    ),
})
