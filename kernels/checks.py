"""Argument checks shared by the kernels and their references.

What every kernel needs of a tensor is checked here once, with one text each: a torch.Tensor, of a
dtype it computes in (FLOAT_DTYPES; COPY_DTYPES for store_kv's pure copy), its last dim contiguous,
on a CUDA device or under Triton's interpreter. The int arguments use `minillm.checks`.

The attention kernels (flash_attn, flash_decode, attention_ref) share the rest of their checks too.
`strict` is the kernels' side: int32 indices, fp16/bf16/fp32, a contiguous last dim, a tile-sized
head_dim, a CUDA tensor or Triton's interpreter. The references take anything PyTorch can compute
with, so that they stay usable as oracles on odd inputs.
"""

from __future__ import annotations

import os

import torch

from ..checks import check_int

# Triton picks its CPU interpreter when a kernel is decorated, so read the switch the same way.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
COPY_DTYPES = (*FLOAT_DTYPES, torch.float64)
# A quantized KV cache (chapter 08) stores one of these, with one fp32 scale per KV head for K and for V.
KV_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def check_tensor(name: str, t) -> None:
    """A torch.Tensor (checked first, so the checks after it may read dtype, shape and strides)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_last_dim(name: str, t: torch.Tensor) -> None:
    """The kernels index a row's numbers as consecutive: the last dim must have stride 1 (or size 1)."""
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {t.stride()}")


def check_float_tensor(name: str, t, dtypes: tuple | None = FLOAT_DTYPES, *, dims: int | None = None,
                       layout: str = "", contiguous: bool = True) -> None:
    """A tensor of one of `dtypes` (None: any floating-point dtype), `dims`-D when given (`layout`
    names the dims in the error), with a contiguous last dim unless contiguous=False."""
    check_tensor(name, t)
    if dtypes is None:
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    elif t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        raise TypeError(f"{name} must be {', '.join(names[:-1])} or {names[-1]}, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if contiguous:
        check_last_dim(name, t)


def check_device(name: str, t: torch.Tensor) -> None:
    """A Triton kernel runs on a CUDA tensor, or on any tensor under the interpreter."""
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the Triton kernels need CUDA tensors ({name} is on {t.device}) or Triton's "
                         "interpreter: set TRITON_INTERPRET=1 before minillm is imported")


def check_head_dim(head_dim: int) -> None:
    """The kernels hold a whole head in one tile, so head_dim must be a power of two tl.dot accepts."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention kernels need head_dim a power of two in 16..256, "
                         f"got {head_dim}")


def check_index(name: str, t, shape: tuple, strict: bool) -> None:
    """An integer index tensor (int32 for the kernels) of the given shape (None: any size there)."""
    check_tensor(name, t)
    if strict and t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {tuple(t.shape)}")


def check_kv_scales(k: torch.Tensor, v: torch.Tensor, k_scale, v_scale) -> bool:
    """A quantized cache (k, v in KV_QUANT_DTYPES, one dtype) needs k_scale and v_scale, fp32 [Hkv] on
    its device; a full-precision one takes none. True when the cache is quantized."""
    quantized = k.dtype in KV_QUANT_DTYPES or v.dtype in KV_QUANT_DTYPES
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale dequantize an fp8 or int8 cache; this cache is {k.dtype}")
        return False
    if k.dtype != v.dtype:
        raise TypeError(f"a quantized cache stores K and V in one dtype, got {k.dtype} and {v.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a {k.dtype} cache needs {name} (fp32, one per KV head) to be read back")
        check_tensor(name, s)
        if s.dtype != torch.float32 or s.shape != k.shape[-2:-1]:
            raise ValueError(f"{name} must be float32 of shape [num_kv_heads] = ({k.shape[-2]},), got "
                             f"{s.dtype} {tuple(s.shape)}")
        if s.device != k.device:
            raise ValueError(f"{name} is on {s.device} but the cache is on {k.device}")
    return True


def check_fp8_device(t: torch.Tensor) -> None:
    """Triton's fp8 e4m3 (float8e4nv) needs an Ada or Hopper GPU (compute capability >= 8.9)."""
    if t.dtype == torch.float8_e4m3fn and t.device.type == "cuda" \
            and torch.cuda.get_device_capability(t.device) < (8, 9):
        name = torch.cuda.get_device_name(t.device)
        raise ValueError(f"an fp8 (e4m3) KV cache needs a GPU with compute capability >= 8.9 (Ada, Hopper); "
                         f"{name} has {torch.cuda.get_device_capability(t.device)}: use kv_cache_dtype='int8'")


def check_qkv(q, k, v, k_dims: int, strict: bool, k_scale=None, v_scale=None) -> None:
    """q [..., Hq, D]; k, v of k_dims dims ending [Hkv, D]; one dtype and device (or k, v quantized, with
    their scales); Hq a multiple of Hkv."""
    check_float_tensor("q", q, FLOAT_DTYPES if strict else None, contiguous=strict)
    check_tensor("k", k)
    check_tensor("v", v)
    quantized = check_kv_scales(k, v, k_scale, v_scale)
    for name, t in (("k", k), ("v", v)):
        if not quantized:
            check_float_tensor(name, t, FLOAT_DTYPES if strict else None, contiguous=strict)
        elif strict:
            check_last_dim(name, t)
    if k.dim() != k_dims or k.shape != v.shape:
        raise ValueError(f"k and v must both be {k_dims}-D [..., num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not quantized and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"the number of query heads ({q.shape[-2]}) must be a multiple of the number "
                         f"of KV heads ({k.shape[-2]})")
    if strict:
        check_head_dim(q.shape[-1])
        check_device("q", q)
        check_fp8_device(k)
        if INTERPRET and q.dtype == torch.bfloat16:  # seen with Triton 3.9: bf16 tl.dot returns garbage
            raise TypeError("Triton's CPU interpreter gets bfloat16 tl.dot wrong: use float32 or "
                            "float16 on a CPU")


def check_window(sliding_window) -> None:
    check_int("sliding_window", sliding_window, optional=True)


def check_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, block_table,
                 sliding_window, strict: bool, k_scale=None, v_scale=None) -> bool:
    """Validate flash_attn_varlen's arguments; True when K/V come from a cache through a block table."""
    paged = block_table is not None or seqused_k is not None
    if paged and cu_seqlens_k is not None:
        raise ValueError("give either cu_seqlens_k (packed K/V) or block_table and seqused_k (a KV cache), "
                         "not both")
    if not paged and cu_seqlens_k is None:
        raise ValueError("give cu_seqlens_k (packed K/V) or block_table and seqused_k (a KV cache)")
    if paged and (block_table is None or seqused_k is None):
        raise ValueError("a KV cache needs both block_table and seqused_k")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {getattr(q, 'shape', q)!r}")
    check_qkv(q, k, v, 4 if paged else 3, strict, k_scale, v_scale)
    if not paged and k_scale is not None:
        raise ValueError("a quantized K/V (k_scale, v_scale) is read from a cache: give block_table and seqused_k")
    check_index("cu_seqlens_q", cu_seqlens_q, (None,), strict)
    B = cu_seqlens_q.numel() - 1
    if B < 1:
        raise ValueError("cu_seqlens_q must hold at least two offsets (one sequence)")
    if paged:
        check_index("seqused_k", seqused_k, (B,), strict)
        check_index("block_table", block_table, (B, None), strict)
    else:
        check_index("cu_seqlens_k", cu_seqlens_k, (B + 1,), strict)
    check_int("max_seqlen_q", max_seqlen_q)
    check_window(sliding_window)
    return paged
