"""Multi-LoRA in one batch: Punica's shrink and expand (BGMV), one adapter slot per token (chapter 16).

A LoRA adapter adds a low-rank update to a linear layer, y += (x A^T) B^T with A [r, in], B [out, r]
(the scaling folded into B). Serving many adapters at once, every token of a batch may carry a
different one, so the update cannot be one GEMM. Punica splits it in two batched gathers over a
stack of adapters held in GPU slots, A [L, R, in] and B [L, out, R] (R = max_lora_rank: a smaller
adapter is zero-padded), and one slot index per token:

    shrink   s[t] = x[t] . A[slot[t]]^T       [T, in] -> [T, R]   fp32
    expand   y[t] += s[t] . B[slot[t]]^T      [T, R]  -> [T, out] added into y (or a slice of it)

A fused layer (qkv_proj: q, k and v; gate_up_proj: gate and up) has one adapter per part, all reading
the same x: their A's are stacked, [L, S * R, in], so one shrink serves every part, and their B's are
stacked along the output, [L, out, R], with the parts' first columns in `slice_offsets`: one expand
writes every part, column n reading the rank-R chunk of its own part (vLLM's multi-slice kernels).
Two launches a layer, whatever the number of parts.

A token whose slot is -1 (no adapter: the base model, or a CUDA graph's padding row) is left as it
was: its shrink loop runs zero times and its expand loads and stores nothing. The slot indices are
read from a device tensor inside the kernels, so a CUDA graph captured once serves any mix of
adapters: the runner refills the slot buffer before each replay, as it refills the token ids.

Each program handles one token (the "batched gather matrix-vector" of Punica's decode kernel): the
rank is small, so a token's shrink is a [R, in] x [in] product, and its expand [out, R] x [R]. Prefill
tokens run the same way (Punica's SGMV, which groups a segment's tokens into one GEMM, is not here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_float_tensor, check_tensor


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, stride_x, stride_al, stride_ar,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    k_end = tl.where(slot >= 0, K, 0)  # no adapter: the loop runs zero times, nothing is read
    a_row = a_ptr + tl.maximum(slot, 0) * stride_al + r[:, None] * stride_ar  # [BLOCK_R, 1] row starts of A[slot]
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        xk = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_row + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)  # [BR, BK]
        acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)  # [BLOCK_R]
    tl.store(out_ptr + t * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, N, R, stride_s, stride_bl, stride_bn, stride_y, off1, off2,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    # no adapter (slot -1): limits of 0 mask every load and store off
    r_end, n_end = tl.where(slot >= 0, R, 0), tl.where(slot >= 0, N, 0)
    # each column's part (0, 1, 2: off1 and off2 start parts 1 and 2; N when there is none), and so
    # which rank-R chunk of this token's shrink output it reads
    part = (n >= off1).to(tl.int64) + (n >= off2).to(tl.int64)  # [BLOCK_N]
    s = tl.load(s_ptr + t * stride_s + part[:, None] * R + r[None, :],
                mask=(n[:, None] < n_end) & (r[None, :] < r_end), other=0.0)  # [BLOCK_N, BLOCK_R] fp32
    b = tl.load(b_ptr + tl.maximum(slot, 0) * stride_bl + n[:, None] * stride_bn + r[None, :],
                mask=(n[:, None] < n_end) & (r[None, :] < r_end), other=0.0)  # [BLOCK_N, BLOCK_R]
    delta = tl.sum(b.to(tl.float32) * s, axis=1)  # [BLOCK_N]
    y_at = y_ptr + t * stride_y + n
    y = tl.load(y_at, mask=n < n_end, other=0.0)
    # add in fp32 and round once to y's dtype
    tl.store(y_at, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n < n_end)


def _check(x, w, slots, what: str) -> None:
    check_float_tensor(f"{what}: x", x, FLOAT_DTYPES, dims=2, layout="[T, features]")
    check_float_tensor(f"{what}: lora weights", w, FLOAT_DTYPES, dims=3, layout="[slots, ., .]")
    check_tensor(f"{what}: slots", slots)
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        raise TypeError(f"{what}: slots must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.shape[0] != x.shape[0]:
        raise ValueError(f"{what}: one slot per token: slots has {slots.shape[0]}, x {x.shape[0]} rows")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in] . A[slots]^T with A [L, R, in] -> [T, R] fp32; rows with slot -1 are left unwritten
    (lora_expand skips them)."""
    _check(x, a, slots, "lora_shrink")
    T, K = x.shape
    _, R, K2 = a.shape
    if K2 != K:
        raise ValueError(f"lora_shrink: x [T, {K}] and A [L, R, {K2}] need the same inner size")
    out = torch.empty(T, R, dtype=torch.float32, device=x.device)  # [T, R]
    if T:
        _shrink_kernel[(T,)](x, a, slots, out, K, R, x.stride(0), a.stride(0), a.stride(1),
                             BLOCK_R=triton.next_power_of_2(R), BLOCK_K=min(256, triton.next_power_of_2(K)))
    return out


def _parts(slice_offsets, N: int) -> list[int]:
    offsets = list(slice_offsets)
    if not 1 <= len(offsets) <= 3 or offsets[0] != 0 or offsets != sorted(offsets) or offsets[-1] >= max(N, 1):
        raise ValueError(f"slice_offsets must be 1 to 3 increasing first columns starting at 0, inside the "
                         f"{N} outputs; got {offsets}")
    return offsets


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                slice_offsets=(0,)) -> None:
    """y [T, out] += s . B[slots]^T per part, in place: B [L, out, R] holds the parts' B's stacked along
    the output, part i from column slice_offsets[i] on, and it reads s [T, S * R]'s chunk i. y may be
    a column slice of a wider output. Rows with slot -1 are untouched."""
    _check(y, b, slots, "lora_expand")
    T, N = y.shape
    _, N2, R = b.shape
    offsets = _parts(slice_offsets, N)
    if N2 != N or s.shape != (T, len(offsets) * R) or s.stride(1) != 1:
        raise ValueError(f"lora_expand: y [T, {N}], s [T, parts * R] and B [L, {N2}, {R}] do not match "
                         f"(s is {tuple(s.shape)}, {len(offsets)} parts)")
    off1, off2 = (offsets[1:] + [N, N])[:2]
    if T:
        BLOCK_N = min(128, triton.next_power_of_2(N))
        _expand_kernel[(T, triton.cdiv(N, BLOCK_N))](s, b, slots, y, N, R, s.stride(0), b.stride(0), b.stride(1),
                                                      y.stride(0), off1, off2,
                                                      BLOCK_R=triton.next_power_of_2(R), BLOCK_N=BLOCK_N)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             slice_offsets=(0,)) -> None:
    """y [T, out] += (x [T, in] . A[slot]^T) . B[slot]^T per token and part, in place (A [L, S * R, in],
    B [L, out, R], S = len(slice_offsets)); slot -1: untouched. Two launches."""
    lora_expand(y, lora_shrink(x, a, slots), b, slots, slice_offsets)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                 slice_offsets=(0,)) -> None:
    """The plain-PyTorch reference of add_lora: the tokens of each adapter in the batch as one GEMM per
    part (the host reads which slots occur: not for CUDA graphs). fp32 accumulation, one rounding."""
    N, R = y.shape[1], b.shape[2]
    offsets = _parts(slice_offsets, N)
    ends = offsets[1:] + [N]
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)  # [T_slot]
        s = F.linear(x.index_select(0, rows).float(), a[slot].float())  # [T_slot, S * R]
        delta = torch.cat([F.linear(s[:, i * R:(i + 1) * R], b[slot, lo:hi].float())  # [T_slot, part i]
                           for i, (lo, hi) in enumerate(zip(offsets, ends))], dim=1)  # [T_slot, out]
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
