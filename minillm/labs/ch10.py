"""Checks for lab 10: routing (Mixtral's and DeepSeek-V3's), the MoE kernel's alignment step, and MLA's
weight absorption.

route: the student's router against minillm's `select_experts` (layers/moe.py) on random logits.
route_v3: DeepSeek-V3's sigmoid scores, score-correction bias and group-limited choice, against
`select_experts` with topk_method "noaux_tc".
moe_align: the (token, expert) pairs sorted by expert and padded per expert to the kernel's tile rows,
against kernels/fused_moe.py's `moe_align_block_size`.
absorbed_attention: one query against n cached latents, computed the absorbed way (W_UK folded into
the query, attention over the latents, W_UV after), against minillm's absorbed path (the paged-MLA
reference, kernels/mla_decode.py, then W_UV), which tests/test_mla.py holds equal to the naive path.
"""

from __future__ import annotations

import random

import torch

from ..config import MoEConfig
from ..kernels.fused_moe import moe_align_block_size
from ..kernels.mla_decode import mla_decode_ref
from ..layers.moe import select_experts
from .checker import check
from .hints import Hints


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


def check_route_v3(fn, cases: int = 60):
    """fn(router_logits [T, E], bias [E], top_k, n_group, topk_group, scaling) -> (weights [T, top_k], ids
    [T, top_k]): DeepSeek-V3's routing (any order of the chosen experts)."""
    def case(rng: random.Random):
        n_group = rng.choice([1, 2, 4, 8])
        E = n_group * rng.choice([2, 4, 8])
        topk_group = rng.randint(1, n_group)
        top_k = rng.randint(1, min(8, topk_group * E // n_group))
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        T = rng.randint(1, 12)
        return (torch.randn(T, E, generator=g) * 2, torch.randn(E, generator=g) * 0.5, top_k, n_group, topk_group,
                rng.choice([1.0, 2.5]))

    def reference(logits, bias, top_k, n_group, topk_group, scaling):
        moe = MoEConfig(num_experts=logits.shape[1], num_experts_per_tok=top_k, moe_intermediate_size=1,
                        norm_topk_prob=True, scoring_func="sigmoid", routed_scaling_factor=scaling,
                        topk_method="noaux_tc", n_group=n_group, topk_group=topk_group)
        return _by_expert(*select_experts(logits, moe, bias))

    def student(logits, bias, *rest):
        out = fn(logits.clone(), bias.clone(), *rest)
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            return out
        return _by_expert(*out) if out[0].shape == out[1].shape == (logits.shape[0], rest[0]) else out

    def equal(got, want):
        return (isinstance(got, tuple) and torch.equal(got[1], want[1])
                and torch.allclose(got[0], want[0], atol=1e-5))

    return check("route_v3", student, reference, case, cases=cases, equal=equal)


def check_moe_align(fn, cases: int = 100):
    """fn(topk_ids [T, top_k], block_m, num_experts) -> (sorted_ids, expert_ids): the pair ids t * top_k + j
    grouped by expert (ascending; token order inside an expert), each expert's run padded with T * top_k to a
    multiple of block_m (experts with no pair take no rows), and the expert of every block_m-row tile."""
    def case(rng: random.Random):
        E, T = rng.choice([2, 4, 8, 16]), rng.randint(1, 20)
        top_k = rng.randint(1, min(E, 4))
        skew = [rng.random() ** 3 for _ in range(E)]  # some experts popular, some idle
        ids = [rng.sample(range(E), top_k) if rng.random() < 0.5 else
               list(dict.fromkeys(rng.choices(range(E), weights=skew, k=8 * top_k)))[:top_k] for _ in range(T)]
        ids = [row + [e for e in range(E) if e not in row][: top_k - len(row)] for row in ids]
        return torch.tensor(ids, dtype=torch.int32), rng.choice([1, 2, 4, 16]), E

    def reference(topk_ids, block_m, num_experts):
        sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block_m, num_experts)
        n = int(total[0])
        return sorted_ids[:n].long(), expert_ids[: n // block_m].long()

    def student(topk_ids, block_m, num_experts):
        out = fn(topk_ids.clone(), block_m, num_experts)
        if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
            return out[0].long(), out[1].long()
        return out

    def equal(got, want):
        return isinstance(got, tuple) and len(got) == 2 and all(
            g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))

    return check("moe_align", student, reference, case, cases=cases, equal=equal)


hint = Hints("10", {
    "route": (
        "The softmax runs over all experts before choosing; the choice is the top_k of those probabilities.",
        "probs = softmax(logits) over E; topk gives weights and ids; with renormalize, divide the k weights by "
        "their sum so they add to 1.",
        "probs = router_logits.float().softmax(-1)\nweights, ids = probs.topk(top_k, -1)\n"
        "if renormalize: weights = weights / weights.sum(-1, keepdim=True)",
    ),
    "route_v3": (
        "V3 scores each expert with a sigmoid (not a softmax), and the bias only steers the choice: the weights "
        "come from the scores without it.",
        "choice = sigmoid(logits) + bias, seen as [T, n_group, E / n_group]; a group's score is the sum of its "
        "best two choices; keep the topk_group best groups (others -inf), take the top_k experts by choice, "
        "weights = unbiased scores of those experts, divided by their sum, times scaling.",
        "s = logits.sigmoid(); choice = s + bias\ng = choice.view(T, n_group, -1).topk(2, -1).values.sum(-1)\n"
        "keep = zeros_like(g, bool).scatter(1, g.topk(topk_group, -1).indices, True)\n"
        "ids = choice.masked_fill(~keep.repeat_interleave(E // n_group, 1), -inf).topk(top_k, -1).indices\n"
        "w = s.gather(1, ids); return w / w.sum(-1, keepdim=True) * scaling, ids",
    ),
    "moe_align": (
        "Number the pairs t * top_k + j (the flattened topk_ids). Count how many pairs each expert gets first.",
        "Each expert's run takes ceil(count / block_m) * block_m rows; its runs start at the running sum of "
        "those sizes. A stable argsort of the flattened ids groups the pairs by expert in token order; a pair's "
        "row is its expert's start plus its rank inside the expert; every other row holds the pad id T * top_k. "
        "Tile i's expert is the expert whose run contains row i * block_m.",
        "flat = topk_ids.flatten().long(); counts = torch.bincount(flat, minlength=E)\n"
        "padded = (counts + block_m - 1) // block_m * block_m; ends = padded.cumsum(0)\n"
        "order = flat.argsort(stable=True); e = flat[order]\n"
        "rank = torch.arange(len(flat)) - (counts.cumsum(0) - counts)[e]\n"
        "out = torch.full((int(ends[-1]),), len(flat)); out[(ends - padded)[e] + rank] = order\n"
        "tiles = torch.searchsorted(ends, torch.arange(0, int(ends[-1]), block_m), right=True)",
    ),
    "absorbed_attention": (
        "q · (W_UK c) = (W_UK^T q) · c: move the up-projection onto the query side.",
        "q_lat = einsum('hp,hpl->hl', q_nope, w_uk) [H, L]; scores = (q_lat @ c.T + q_pe @ k_pe.T) * scale; "
        "the softmax-weighted sum of the latents c is [H, L]; W_UV comes after it.",
        "q_lat = torch.einsum('hp,hpl->hl', q_nope, w_uk)\nscores = (q_lat @ c.T + q_pe @ k_pe.T) * scale\n"
        "o = scores.softmax(-1) @ c\nreturn torch.einsum('hl,hvl->hv', o, w_uv)",
    ),
})
