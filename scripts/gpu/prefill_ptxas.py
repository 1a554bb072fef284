"""Compile the prefill kernel for an H100 (sm_90) on a machine without a GPU, and print per tile what
ptxas says: registers, spills, shared memory, and whether the code has wgmma and TMA copies.

The CPU tests run the kernel in Triton's interpreter, which accepts code the compiler refuses (a
helper returning tensors of two shapes ran there and failed to compile); this catches that, and shows
the register pressure that decides a tile's speed, before a GPU call is spent. Triton ships ptxas.

    python scripts/gpu/prefill_ptxas.py                       # D=128 bf16 causal, packed K/V via TMA
    python scripts/gpu/prefill_ptxas.py --path pointer --grid head --head-dim 64
    PYTHONPATH=/tmp/t36 python scripts/gpu/prefill_ptxas.py   # against another Triton (the GPU image's 3.6)

Run it without TRITON_INTERPRET (the kernel must be a compiled function, not an interpreted one).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from minillm.kernels import flash_attn as fa


def compile_tile(path: str, grid: str, D: int, dtype: str, tile: tuple[int, int, int, int]) -> dict:
    block_m, block_n, warps, stages = tile
    fn = fa._flash_attn_fwd
    sig = {name: "i32" for name in fn.arg_names}
    sig |= {"Q": f"*{dtype}", "Out": f"*{dtype}", "Lse": "*fp32", "K_scale": "*fp32", "V_scale": "*fp32",
            "qk_scale": "fp32"}
    sig |= {name: "*i32" for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table")}
    kv = f"tensordesc<{dtype}[{block_n},{D}]>" if path == "tma" else f"*{dtype}"
    sig |= {"K": kv, "V": kv}
    consts = dict(HEAD_DIM=D, PAGED=path == "paged", CAUSAL=True, HAS_WINDOW=False, RETURN_LSE=False,
                  IEEE=dtype == "fp32", QUANT_KV=False, USE_TMA=path == "tma", GQA_GRID=grid == "gqa",
                  BLOCK_M=block_m, BLOCK_N=block_n)
    sig |= dict.fromkeys(consts, "constexpr")
    # What Triton's launcher specialises on at run time: pointers 16-byte aligned, and the strides the
    # model's shapes make multiples of 16 (without this the compiler cannot vectorise or pipeline loads).
    aligned = [n for n, t in sig.items() if t.startswith("*")] + [
        "stride_q_tok", "stride_q_head", "stride_k_blk", "stride_k_tok", "stride_k_head", "stride_v_blk",
        "stride_v_tok", "stride_v_head", "stride_o_tok", "stride_o_head"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = get_ptxas(90)
    ptxas = ptxas.path if hasattr(ptxas, "path") else ptxas[0]
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                            text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"tile": f"{block_m}x{block_n} w{warps} s{stages}", "registers": int(regs[1]) if regs else None,
            "spill_bytes": int(spills[1]) if spills else None, "shared_bytes": kernel.metadata.shared,
            "wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=["tma", "pointer", "paged"], default="tma")
    p.add_argument("--grid", choices=["gqa", "head"], default="gqa")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--tiles", choices=["tuned", "v0"], default="tuned")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter has nothing to compile")
    print(f"triton {triton.__version__}, sm_90, {args.path} K/V, {args.grid} grid, D={args.head_dim}, {args.dtype}")
    for tile in fa.TUNED_TILES if args.tiles == "tuned" else fa.V0_TILES:
        row = compile_tile(args.path, args.grid, args.head_dim, args.dtype, tile)
        print("  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
