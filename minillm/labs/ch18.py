"""Checks for lab 18: the split-K partial kernel of the decode GEMV, with its RMSNorm prologue.

The student writes a Triton kernel `gemv_partials`: program (n, s, m) multiplies one [BLOCK_N, BLOCK_K]
tile of W by row m of x (times the norm's gain g when NORM) over K slice s, and stores the tile's partial
sums and, from the column tile n = 0, the slice's sum of x^2. `split_k_gemv` (below) launches it and
finishes as kernels/gemv.py's last-arriving program does: the partials added in split order s = 0, 1, ...,
the rstd of the summed squares, the bias, SiLU-and-mul, the residual, each rounded where the unfused ops
round.

The check runs it on fresh random shapes with tails against `gemv_ref` (the plain PyTorch ops: RMSNorm,
F.linear, SiLU-and-mul, the residual add), natively on a GPU or in Triton's interpreter on a CPU; checks
that a row gives the same bits alone and in a batch (the fixed order); then routes every decode projection
of a tiny model through it inside the engine (decode_backend="pdl") and compares the greedy tokens with
decode_backend="graphs".
"""

from __future__ import annotations

import random

import torch

from ..bench.serving_setup import NoTextTokenizer
from ..config import ModelConfig
from ..engine import EngineConfig, LLMEngine
from ..layers.backend import kernel_mode
from ..loader import load_model
from ..sampling import SamplingParams
from .ch13 import _triton_ready
from .checker import CheckFailed, Verdict, check
from .hints import Hints


def split_k_gemv(kernel, x, weight, bias=None, *, norm_weight=None, eps=1e-6, residual=None, silu_mul=False,
                 block=(8, 32), **_):
    """epilogue(prologue(x) @ weight^T) with the student's partial kernel; kernels/gemv.py's signature
    (its pdl= and config= are accepted and ignored). x [M, K], weight [N, K] -> [M, N] ([M, N / 2] with
    silu_mul). block: (BLOCK_N, BLOCK_K)."""
    import triton

    M, K = x.shape
    N = weight.shape[0]
    block_n, block_k = block
    split, n_tiles = triton.cdiv(K, block_k), triton.cdiv(N, block_n)
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)  # every entry written
    sq = torch.empty((split, M), dtype=torch.float32, device=x.device)
    norm = norm_weight is not None
    kernel[(n_tiles, split, M)](x, weight, norm_weight if norm else x, part, sq, N, K, x.stride(0), weight.stride(0),
                                BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm)
    acc = part[0].clone()  # [M, N]: the splits in order s = 0, 1, ...: the same bits whatever M is
    for s in range(1, split):
        acc += part[s]
    if norm:
        ss = sq[0].clone()  # [M]
        for s in range(1, split):
            ss += sq[s]
        acc *= torch.rsqrt(ss / K + eps)[:, None]
    if bias is not None:
        acc += bias.float()
    y = acc.to(x.dtype)  # F.linear rounds once, after its bias
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    if residual is not None:
        y = (y.float() + residual.float()).to(x.dtype)
    return y


def check_gemv_partials(kernel, cases: int | None = None, engine: bool = True, seed: int | None = None) -> Verdict:
    """kernel: the lab's @triton.jit gemv_partials (see split_k_gemv for how it is launched)."""
    from ..kernels.gemv import gemv_ref

    name = "gemv_partials"
    gpu = _triton_ready(name)
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    cases = cases or (30 if gpu else 6)

    def case(rng: random.Random):
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        M, N, K = rng.randint(1, 8), rng.choice([6, 24, 40]), rng.choice([16, 50, 100])
        x = (torch.randn(M, K, generator=g) * rng.choice([0.3, 1.0, 4.0])).to(device, dtype)
        w = (torch.randn(N, K, generator=g) * K**-0.5).to(device, dtype)
        norm = rng.random() < 0.7
        gain = (1 + 0.3 * torch.randn(K, generator=g)).to(device, dtype) if norm else None
        silu = rng.random() < 0.3 and N % 2 == 0
        res = torch.randn(M, N // 2 if silu else N, generator=g).to(device, dtype) if rng.random() < 0.5 else None
        block = (rng.choice([8, 16]), rng.choice([16, 32]))
        return x, w, gain, res, silu, rng.choice([1e-5, 1e-6]), block

    def student(x, w, gain, res, silu, eps, block):
        return split_k_gemv(kernel, x, w, norm_weight=gain, eps=eps, residual=res, silu_mul=silu, block=block)

    def reference(x, w, gain, res, silu, eps, block):
        # the unfused ops in fp32 on the same (rounded) inputs, rounded once at the end
        f = (lambda t: None if t is None else t.float())
        return gemv_ref(x.float(), w.float(), norm_weight=f(gain), eps=eps, residual=f(res), silu_mul=silu).to(x.dtype)

    tol = (3e-2, 2e-2) if gpu else (2e-5, 2e-5)  # bf16: an ulp or two of the output; fp32: the sums' order

    def close(got, want):
        return (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got.float(), want.float(), atol=tol[0], rtol=tol[1]))

    verdict = check(name, student, reference, case, cases=cases, equal=close, seed=seed)
    _check_batch_invariance(student, case, random.Random(seed if seed is not None else random.randrange(1 << 30)))
    if engine:
        _check_in_the_engine(kernel, device)
    return verdict


def _check_batch_invariance(student, case, rng: random.Random) -> None:
    """Row m of a batch is the same bits as row m alone: each row its own multiply, the splits in order."""
    for _ in range(3):
        x, w, gain, res, silu, eps, block = case(rng)
        batched = student(x, w, gain, res, silu, eps, block)
        for m in {0, x.shape[0] - 1}:
            alone = student(x[m:m + 1], w, gain, None if res is None else res[m:m + 1], silu, eps, block)
            if not torch.equal(alone[0], batched[m]):
                raise CheckFailed(f"❌ gemv_partials: row {m} of a batch of {x.shape[0]} differs from the same row "
                                  f"alone (max |diff| {(alone[0] - batched[m]).abs().max().item():.3g}): does a "
                                  "program read or write another row's numbers?")
    print("✅ gemv_partials: a row gives the same bits alone and in a batch")


# ---- inside the engine ---------------------------------------------------------------------------------

_MODEL = None


def tiny_model(device) -> torch.nn.Module:
    """A 2-layer random Llama, fp32 (built once per device): large weights, so the greedy tokens have clear
    winners that two correct GEMVs agree on."""
    global _MODEL
    if _MODEL is None or next(_MODEL.parameters()).device.type != torch.device(device).type:
        cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, name="lab18-random")
        model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device(device))
        g = torch.Generator().manual_seed(18)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                norm = "norm" in pname
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
        _MODEL = model
    return _MODEL


def greedy_tokens(device, backend: str, prompts: list[list[int]], max_tokens: int, gemv=None,
                  eager: bool = False) -> tuple[list, int]:
    """The tiny model's greedy tokens for `prompts` with decode_backend `backend`; gemv: a stand-in for
    kernels/gemv.py's `gemv` (the student's); eager: no CUDA graphs (each launch goes through Python).
    -> (tokens per prompt, GEMV calls made)."""
    from ..kernels import gemv as gemv_module

    calls = [0]
    original = gemv_module.gemv

    def counting(*args, **kwargs):
        calls[0] += 1
        return (gemv or original)(*args, **kwargs)

    gemv_module.gemv = counting  # what layers/decode_gemv.py calls, through the module
    try:
        with kernel_mode("triton"):
            engine = LLMEngine(tiny_model(device), NoTextTokenizer(), [],
                               EngineConfig(block_size=4, num_gpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=32,
                                            decode_backend=backend, enforce_eager=eager), progress=False)
            for i, p in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": p},
                                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            done = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished and o.error:
                        raise RuntimeError(f"the tiny model's request failed on the engine ({backend}): {o.error}")
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
            engine.shutdown()
    finally:
        gemv_module.gemv = original
        from ..layers.decode_gemv import enable_decode_gemv

        enable_decode_gemv(tiny_model(device), None)  # the model is shared: leave it on its own path
    return [done[str(i)] for i in range(len(prompts))], calls[0]


def _check_in_the_engine(kernel, device) -> None:
    if device == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        print("⏭  gemv_partials (engine): decode_backend='pdl' needs a Hopper GPU; not run here (not counted as passed)")
        return
    rng = random.Random()
    prompts = [[rng.randrange(128) for _ in range(rng.randint(3, 7))] for _ in range(2)]
    want, _ = greedy_tokens(device, "graphs", prompts, 3)

    def student_gemv(x, weight, bias=None, **kw):  # tiles of 32 x 32: few programs for the interpreter
        return split_k_gemv(kernel, x, weight, bias, **{**kw, "block": (32, 32)})

    got, calls = greedy_tokens(device, "pdl", prompts, 3, gemv=student_gemv)
    if calls == 0:
        raise CheckFailed("❌ gemv_partials (engine): the decode steps never called the GEMV")
    if got != want:
        raise CheckFailed(f"❌ gemv_partials (engine): with your kernel in every decode projection the tiny model's "
                          f"greedy tokens are {got}; decode_backend='graphs' gives {want} (prompts {prompts})")
    print(f"✅ gemv_partials (engine): {calls} decode projections through your kernel, greedy tokens equal "
          "decode_backend='graphs'")


hint = Hints("18", {
    "gemv_partials": (
        "One program per (column tile n, K slice s, row m): tl.program_id(0), (1), (2). Build offs_n and offs_k "
        "from them, load the [BLOCK_N, BLOCK_K] tile of W and the [BLOCK_K] slice of row m of x, masked past N "
        "and K (other=0.0), and do the arithmetic in fp32.",
        "The sum of squares is of x itself (before the gain): ss = tl.sum(x * x). With NORM, multiply x by the "
        "gain g[offs_k] *after* that, then acc = tl.sum(w * x[None, :], axis=1). Store acc at "
        "PART + (s * M + m) * N + offs_n, where M = tl.num_programs(2), and ss at SQ + s * M + m from "
        "the programs with n == 0 only.",
        "pid_n, pid_s, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)\n"
        "M = tl.num_programs(2)\n"
        "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N); offs_k = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)\n"
        "n_ok, k_ok = offs_n < N, offs_k < K\n"
        "w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], "
        "other=0.0).to(tl.float32)\n"
        "x = tl.load(X + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)\n"
        "ss = tl.sum(x * x, axis=0)\n"
        "if NORM: x = x * tl.load(G + offs_k, mask=k_ok, other=0.0).to(tl.float32)\n"
        "tl.store(PART + (pid_s * M + m) * N + offs_n, tl.sum(w * x[None, :], axis=1), mask=n_ok)\n"
        "if pid_n == 0: tl.store(SQ + pid_s * M + m, ss)"),
})
