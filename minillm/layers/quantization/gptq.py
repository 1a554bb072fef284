"""GPTQ (Frantar et al., 2022): round one weight column at a time and let the others make up for it.

    LLM(quantization={"method": "gptq", "group_size": 64})     # calibrates at load on the corpus

Round-to-nearest treats every weight alone. But a layer's error is what its *output* gets wrong,
||X W^T - X Q^T||^2 over real inputs X [T, K], and that is a quadratic form in the weight error
with the Hessian H = 2 X^T X [K, K]. Inputs are correlated, so after rounding column i, the columns
not yet rounded can move to cancel most of the damage (Optimal Brain Surgeon's update):

    err = (w_i - q_i) / [H_F^-1]_ii                    F: the columns not rounded yet, i first
    W[:, F] -= err (outer) [H_F^-1]_i,F                (column i itself lands exactly on q_i)

GPTQ's three tricks make that cheap and stable: columns are rounded in a fixed order for all rows at
once (so H_F^-1 is shared by every row); the rows of H_F^-1 needed along the way are the rows of
the upper Cholesky factor U of H^-1 (H^-1 = U^T U: row i of U, divided by U_ii, is row i of H_F^-1
divided by its diagonal, for F = {i, i+1, ...}); and the updates are applied lazily, inside blocks
of 128 columns, with one matrix product per block for the columns beyond it (`block_size`).

A dampening of `damp` x mean(diag H) is added to H's diagonal (a column no input touches would
make H singular; its weights are set to 0). Groups: each group of `group_size` columns gets its
(scale, min) from its columns *as updated so far*, when the first of them is reached, so the grid
follows the error feedback. `act_order=True` rounds the columns of largest diag(H) (the most used
inputs) first, while each has the most other columns left to absorb its error; the group grids are
then fixed up front from the original weights ("static groups"), so that a group still means
`group_size` consecutive inputs: the layout, and the W4A16 kernel, stay the `int4` method's.
"""

from __future__ import annotations

import torch

from .calibration import (
    CalibratedConfig,
    block_linears,
    check_divides,
    check_group_size,
    dequantize_grid,
    grid_params,
    group_range,
    quantize_to_grid,
)
from .int4 import become_int4
from .utils import pack_int4


def hessian(x: torch.Tensor) -> torch.Tensor:
    """Inputs x [T, K] -> H = 2 X^T X / T [K, K] in fp32 (the 1/T keeps damp's scale independent of T)."""
    x = x.float()
    return 2 * (x.T @ x) / x.shape[0]


def inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """H [K, K] -> U, upper triangular with U^T U = (H + damp * mean(diag H) * I)^-1."""
    H = H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    L = torch.linalg.cholesky(H)  # H = L L^T
    # H^-1 = L^-T L^-1 (a triangular solve: torch.cholesky_inverse runs 25x slower on some CPU builds)
    L_inv = torch.linalg.solve_triangular(L, torch.eye(len(H), dtype=H.dtype, device=H.device), upper=False)
    return torch.linalg.cholesky(L_inv.T @ L_inv, upper=True)


def column_update(W: torch.Tensor, U: torch.Tensor, i: int, wq: torch.Tensor) -> torch.Tensor:
    """One GPTQ step: column i of W [N, B] is replaced by its rounded value wq [N] and the error is
    spread over columns i+1.. by row i of U [B, B]. Returns err [N] (for the block's lazy update)."""
    err = (W[:, i] - wq) / U[i, i]  # [N]
    W[:, i:].addr_(err, U[i, i:], alpha=-1)  # [N, B - i] -= err (outer) U[i, i:]; leaves W[:, i] at wq
    return err


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, group_size: int, *, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """W [N, K] and its Hessian H [K, K] -> the int4 method's tensors (qweight, scales, mins)."""
    N, K = w.shape
    dtype = dtype or w.dtype
    if K % group_size or block_size % group_size:
        raise ValueError(f"GPTQ needs group_size ({group_size}) to divide K ({K}) and block_size ({block_size})")
    W = w.float().clone()
    H = H.float().clone()
    dead = H.diagonal() == 0  # inputs that were always 0: any weight is right, 0 is the simplest
    H[dead, dead] = 1
    W[:, dead] = 0
    G = K // group_size
    scales = torch.empty(N, G, dtype=dtype, device=W.device)
    mins = torch.empty(N, G, dtype=dtype, device=W.device)
    perm = torch.arange(K, device=W.device)
    if act_order:
        scales[:], mins[:] = grid_params(*group_range(W, group_size), dtype)  # static groups
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    U = inverse_cholesky(H, damp)  # [K, K]
    Q = torch.zeros_like(W)  # [N, K] levels 0..15, in the processing order
    for b1 in range(0, K, block_size):
        b2 = min(b1 + block_size, K)
        W1, U1 = W[:, b1:b2].clone(), U[b1:b2, b1:b2]  # this block, updated eagerly
        Err1 = torch.zeros_like(W1)
        for i in range(b2 - b1):
            col = int(perm[b1 + i])
            g = col // group_size
            if not act_order and col % group_size == 0:  # a group starts: its grid from its updated columns
                cols = W1[:, i:i + group_size]  # [N, G]
                scales[:, g], mins[:, g] = grid_params(cols.amin(1), cols.amax(1), dtype)
            q = quantize_to_grid(W1[:, i], scales[:, g], mins[:, g])  # [N]
            Q[:, b1 + i] = q
            Err1[:, i] = column_update(W1, U1, i, dequantize_grid(q, scales[:, g], mins[:, g]))
        W[:, b2:] -= Err1 @ U[b1:b2, b2:]  # the block's errors, spread over every later column at once
    Q = Q[:, torch.argsort(perm)]  # back to the input order
    return {"qweight": pack_int4(Q), "scales": scales, "mins": mins}


class GPTQConfig(CalibratedConfig):
    """int4 groups placed by GPTQ. Options: group_size (32, 64, 128), damp, act_order, block_size, and
    the calibration's num_sequences x seq_len (None: 16 x 256 on a CPU, 64 x 512 on a GPU) or
    path (a result saved by `minillm quantize`)."""

    name = "gptq"
    options = ("group_size", "damp", "act_order", "block_size", "num_sequences", "seq_len", "path")

    def __init__(self, group_size: int = 128, damp: float = 0.01, act_order: bool = False, block_size: int = 128,
                 num_sequences: int | None = None, seq_len: int | None = None, path=None):
        check_group_size(self.name, group_size)
        if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp < 1:
            raise ValueError(f"quantization 'gptq' damp must be a number in (0, 1), not {damp!r}")
        if not isinstance(act_order, bool):
            raise ValueError(f"quantization 'gptq' act_order must be True or False, not {act_order!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < group_size or \
                block_size % group_size:
            raise ValueError(f"quantization 'gptq' block_size must be a multiple of group_size ({group_size}), "
                             f"not {block_size!r}")
        self.damp, self.act_order, self.block_size = float(damp), act_order, block_size
        super().__init__(group_size, num_sequences, seq_len, path)

    def quantize_block(self, block, inputs):
        for name, layer in block_linears(block).items():
            check_divides(self.name, layer, layer.weight.shape[1], self.group_size)
            tensors = gptq_quantize(layer.weight.data, hessian(inputs[name]), self.group_size, damp=self.damp,
                                    block_size=self.block_size, act_order=self.act_order, dtype=layer.weight.dtype)
            become_int4(layer, tensors, self.group_size)
