"""Checks for lab 11: sharding a linear layer by columns and by rows, the tensor-parallel MLP (column,
then row: one sum), the vocabulary-parallel embedding's mask, and (optional) the alpha-beta fit.

Every reference is minillm's own layer built as rank r of p inside one process
(`simulate_tensor_parallel`), filled from the one full tensor through its `weight_loader`, on fresh
random shapes and values. A simulated rank's collectives return its own part, so a layer's output is
exactly what that rank computes before the all-reduce.
"""

from __future__ import annotations

import random

import torch

from ..distributed import simulate_tensor_parallel
from ..distributed.cost_model import fit_alpha_beta
from ..layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ..layers.activation import SiluAndMul
from .checker import check
from .hints import Hints

EPS = torch.finfo(torch.float32).eps


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _rank_layer(rank: int, p: int, build, fills: list[tuple]):
    """build() as rank `rank` of p, each (param name, full tensor[, shard id]) loaded through its weight_loader."""
    with simulate_tensor_parallel(rank, p):
        layer = build()
    for name, tensor, *shard in fills:
        param = getattr(layer, name)
        param.weight_loader(param, tensor, *shard)
    return layer


def _tensor_equal(got, want) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


# ---- exercise 1: the two ways to cut a weight ------------------------------------------------------


def _shard_case(rng: random.Random):
    p = rng.choice([2, 3, 4])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    N, K = p * rng.randint(1, 6), p * rng.randint(1, 6)
    return _randn(g, N, K), rng.randrange(p), p


def _check_shard(name: str, fn, layer_cls, cases: int):
    def reference(weight, rank, p):
        layer = _rank_layer(rank, p, lambda: layer_cls(weight.shape[1], weight.shape[0]), [("weight", weight)])
        return layer.weight.data

    return check(name, lambda w, r, p: fn(w.clone(), r, p), reference, _shard_case, cases=cases, equal=_tensor_equal)


def check_column_shard(fn, cases: int = 30):
    """fn(weight [N, K], rank, world_size) -> rank's [N / p, K]: what ColumnParallelLinear holds."""
    return _check_shard("column_shard", fn, ColumnParallelLinear, cases)


def check_row_shard(fn, cases: int = 30):
    """fn(weight [N, K], rank, world_size) -> rank's [N, K / p]: what RowParallelLinear holds."""
    return _check_shard("row_shard", fn, RowParallelLinear, cases)


# ---- exercise 2: column, then row, then one sum -------------------------------------------------------


def _mlp_case(rng: random.Random):
    p = rng.choice([2, 3, 4])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    H, I, T = rng.randint(4, 24), p * rng.randint(1, 8), rng.randint(1, 6)
    return _randn(g, T, H), _randn(g, I, H), _randn(g, I, H), _randn(g, H, I), p


def _mlp_reference(x, gate, up, down, p):
    """minillm's layers as each rank: gate_up_proj (merged column) -> SiLU * up -> down_proj (row), the
    ranks' partial outputs before the all-reduce."""
    act, parts = SiluAndMul(), []
    H, I = x.shape[1], gate.shape[0]
    for r in range(p):
        gate_up = _rank_layer(r, p, lambda: MergedColumnParallelLinear(H, [I, I]), [("weight", gate, 0),
                                                                                    ("weight", up, 1)])
        down_proj = _rank_layer(r, p, lambda: RowParallelLinear(I, H), [("weight", down)])
        with torch.no_grad():
            parts.append(down_proj(act(gate_up(x))))  # [T, H]: rank r's partial sum
    return parts


def check_mlp_partial_sums(fn, cases: int = 20):
    """fn(x [T, H], gate [I, H], up [I, H], down [H, I], world_size) -> the p ranks' partial outputs
    [T, H] each, computed from each rank's shards alone; they must match minillm's rank layers and
    sum to the unsharded MLP."""
    def close(got, want):
        if not (isinstance(got, (list, tuple)) and len(got) == len(want)):
            return False
        if not all(isinstance(a, torch.Tensor) and a.shape == b.shape for a, b in zip(got, want)):
            return False
        # the same dot products per rank: fp32 ordering only (K <= 32 terms of size ~|x||w|)
        return all(torch.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(got, want))

    def reference(x, gate, up, down, p):
        parts = _mlp_reference(x, gate, up, down, p)
        mlp = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T  # [T, H], unsharded
        h = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)).abs()
        bound = gate.shape[0] * EPS * (h @ down.abs().T) * 4 + 1e-5  # the row split reorders a sum of I terms
        assert ((sum(parts) - mlp).abs() <= bound).all(), "minillm's ranks must sum to the MLP (the all-reduce)"
        return parts

    return check("mlp_partial_sums", lambda x, g_, u, d, p: fn(x.clone(), g_.clone(), u.clone(), d.clone(), p),
                 reference, _mlp_case, cases=cases, equal=close)


# ---- exercise 3: the vocabulary-parallel embedding ---------------------------------------------------


def _embed_case(rng: random.Random):
    p = rng.choice([2, 3, 4])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    V, H, T = rng.randint(p, 60), rng.randint(1, 8), rng.randint(1, 20)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[0] = V - 1  # the last token: in the last rank's (perhaps short) slice
    return _randn(g, V, H), ids, rng.randrange(p), p


def check_embedding_shard(fn, cases: int = 40):
    """fn(table [V, H], ids [T], rank, world_size) -> rank's [T, H] before the all-reduce: its rows for
    the tokens in its slice of ceil(V / p) ids, zeros for the others (VocabParallelEmbedding)."""
    def reference(table, ids, rank, p):
        layer = _rank_layer(rank, p, lambda: VocabParallelEmbedding(*table.shape), [("weight", table)])
        with torch.no_grad():
            return layer(ids)

    return check("embedding_shard", lambda t, i, r, p: fn(t.clone(), i.clone(), r, p), reference, _embed_case,
                 cases=cases, equal=_tensor_equal)


# ---- exercise 4 (optional): fit alpha and beta -----------------------------------------------------


def _fit_case(rng: random.Random):
    alpha, beta = rng.uniform(2e-6, 500e-6), rng.uniform(1e9, 400e9)  # seconds, bytes per second
    p = rng.choice([2, 4, 8])
    sizes = [8192]
    while len(sizes) < 4 or sizes[-1] < 20 * p * alpha * beta:  # up to where n / beta dwarfs alpha: both show
        sizes.append(sizes[-1] * rng.choice([2, 4]))
    times = [(2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta) * rng.uniform(0.95, 1.05) for n in sizes]  # noisy
    return sizes, times, p


def check_fit_alpha_beta(fn, cases: int = 30):
    """fn(sizes, times, world_size) -> (alpha seconds, beta bytes/s) of the ring model, fitted by least
    squares on relative errors, as minillm.distributed.cost_model.fit_alpha_beta (to 1e-4: the two may
    solve the same 2x2 problem by different routes, and the columns differ in scale by 1e5 and more)."""
    def reference(sizes, times, p):
        ab = fit_alpha_beta(sizes, times, p, "ring")
        return ab.alpha, ab.beta

    def close(got, want):
        return (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(v, (int, float)) and abs(v - w) <= 1e-4 * abs(w) for v, w in zip(got, want)))

    return check("fit_alpha_beta", fn, reference, _fit_case, cases=cases, equal=close)


hint = Hints("11", {
    "column_shard": (
        'Column-parallel splits the OUTPUT features: which dimension of a [N, K] weight (y = x @ W.T) is N?',
        'Rank r keeps N / p consecutive rows of W: rows r * N/p up to (r + 1) * N/p. Its output is then its own N/p columns of y.',
        'n = weight.shape[0] // world_size\nreturn weight[rank * n : (rank + 1) * n]',
    ),
    "row_shard": (
        'Row-parallel splits the INPUT features K, the second dimension of the [N, K] weight.',
        'Rank r keeps columns r * K/p up to (r + 1) * K/p of W and sees only those columns of x; each rank makes a full-size [T, N] partial sum.',
        'k = weight.shape[1] // world_size\nreturn weight[:, rank * k : (rank + 1) * k]',
    ),
    "mlp_partial_sums": (
        'Give each rank its slice of the I intermediate features: rows of gate and up (column-parallel), the matching columns of down (row-parallel).',
        'SiLU(gate) * up is element-wise, so a rank can apply it to its own I/p features without talking to anyone. Only down_proj mixes the features: each rank gets a partial sum, and the sum over ranks (the all-reduce) is the MLP.',
        'n = gate.shape[0] // world_size; parts = []\nfor r in range(world_size):\n    s = slice(r * n, (r + 1) * n)\n    h = torch.nn.functional.silu(x @ gate[s].T) * (x @ up[s].T)   # [T, I/p]\n    parts.append(h @ down[:, s].T)                                 # [T, H]\nreturn parts',
    ),
    "embedding_shard": (
        'Rank r owns ids [r * ceil(V/p), (r + 1) * ceil(V/p)), cut at V for the last rank. What should it return for an id it does not own?',
        'Look up ids - start for the ids in range (any valid row, e.g. 0, for the others), then multiply by a 0/1 mask so the ids outside the range give zero rows; the all-reduce then adds one real row and p - 1 zero rows.',
        'per = -(-V // world_size); start = rank * per; end = min(start + per, V)\nmine = (ids >= start) & (ids < end)\nrows = table[torch.where(mine, ids, start)]   # any row of this rank for the masked ids\nreturn rows * mine[:, None]',
    ),
    "fit_alpha_beta": (
        'T(n) = a(n) * alpha + b(n) * g with a = 2(p - 1), b = 2(p - 1)/p * n and g = 1/beta: linear in (alpha, g).',
        'Weight each row by 1/t (minimise the sum of ((a alpha + b g - t) / t)^2) so the small messages count; solve the 2x2 normal equations, or torch.linalg.lstsq on the weighted rows in float64.',
        'A = torch.tensor([[2 * (p - 1) / t, 2 * (p - 1) / p * n / t] for n, t in zip(sizes, times)], dtype=torch.float64)\nsol = torch.linalg.lstsq(A, torch.ones(len(sizes), 1, dtype=torch.float64)).solution\nalpha, g = sol[0, 0].item(), sol[1, 0].item(); return alpha, 1 / g',
    ),
})
