"""Checks for lab 10: top-k routing with renormalisation, and MLA's weight absorption.

route: the student's router against minillm's `select_experts` (layers/moe.py) on random logits.
absorbed_attention: one query against n cached latents, computed the absorbed way (W_UK folded into
the query, attention over the latents, W_UV after), against minillm's absorbed path (the paged-MLA
reference, kernels/mla_decode.py, then W_UV), which tests/test_mla.py holds equal to the naive path.
"""

from __future__ import annotations

import random

import torch

from ..config import MoEConfig
from ..kernels.mla_decode import mla_decode_ref
from ..layers.moe import select_experts
from .checker import check


def _by_expert(weights, ids):
    order = ids.long().argsort(-1)
    return weights.float().gather(1, order), ids.long().gather(1, order)


def check_route(fn, cases: int = 60):
    """fn(router_logits [T, E], top_k, renormalize) -> (weights [T, top_k], ids [T, top_k]); the
    top_k experts of each token in any order, weights the softmax probabilities (renormalised to sum 1
    over the chosen experts when asked)."""

    def case(rng: random.Random):
        T, E = rng.randint(1, 12), rng.choice([4, 8, 16, 64])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        return torch.randn(T, E, generator=g) * 3, rng.randint(1, min(E, 8)), rng.choice([True, False])

    def reference(logits, top_k, renormalize):
        moe = MoEConfig(num_experts=logits.shape[1], num_experts_per_tok=top_k, moe_intermediate_size=1,
                        norm_topk_prob=renormalize)
        return _by_expert(*select_experts(logits, moe))

    def student(logits, top_k, renormalize):
        out = fn(logits.clone(), top_k, renormalize)
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            return out
        if out[0].shape != (logits.shape[0], top_k) or out[1].shape != (logits.shape[0], top_k):
            return out
        return _by_expert(*out)

    def equal(got, want):
        return (isinstance(got, tuple) and torch.equal(got[1], want[1])
                and torch.allclose(got[0], want[0], atol=1e-6))

    return check("route", student, reference, case, cases=cases, equal=equal)


def check_absorbed_attention(fn, cases: int = 40):
    """fn(q_nope [H, P], q_pe [H, R], c [n, L], k_pe [n, R], w_uk [H, P, L], w_uv [H, V, L], scale)
    -> [H, V]: head h attends with key [c W_UK_h^T, k_pe] and value c W_UV_h^T, without forming them."""

    def case(rng: random.Random):
        H, P, R, L, V, n = (rng.randint(1, 6), rng.choice([4, 8]), rng.choice([2, 4]), rng.choice([8, 16]),
                            rng.choice([4, 6]), rng.randint(1, 20))
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))

        def r(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        return r(H, P), r(H, R), r(n, L), r(n, R), r(H, P, L) * P**-0.5, r(H, V, L), rng.uniform(0.1, 0.5)

    def reference(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
        q = torch.cat((torch.einsum("hp,hpl->hl", q_nope, w_uk), q_pe), dim=-1)  # [H, L + R]
        cache = torch.cat((c, k_pe), dim=-1)[None, :, None, :]  # one block holding the n latents
        n, L = c.shape
        o = mla_decode_ref(q[None], cache, torch.tensor([n]), torch.tensor([0]), torch.tensor([[0]]), L, scale)[0]
        return torch.einsum("hl,hvl->hv", o, w_uv)  # [H, V]

    def equal(got, want):  # minillm's reference attends in fp32
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got.double(), want,
                                                                                           rtol=1e-5, atol=1e-5)

    return check("absorbed_attention", fn, reference, case, cases=cases, equal=equal)
