"""Training a learned drafter by self-distillation (chapter 09, part two).

The drafter must guess what *this* target will say, so it learns from the target itself: text the
target generated (minillm train-drafter makes it from a prompt set, with the engine), one dense forward
of the frozen target over each sequence for its hidden states h [n, hidden] and its next-token
distributions p = softmax(lm_head(h)), and the drafter fitted to them:

    Medusa   head j (0-based) from h_t -> the target's p at position t+1+j (its token t+2+j): soft
             cross-entropy, every head on every position that has one
    EAGLE    at position p from (embed(x_p), h_{p-1}) -> g_p: smooth-L1 to h_p (the feature) plus
             0.1 x soft cross-entropy of lm_head(g_p) against p_p (EAGLE's loss and weights), the
             true features fed in (teacher forcing), with a little uniform noise on them (EAGLE's
             remedy for drafting from its own, imperfect, features)

Only the drafter's weights train (AdamW, a cosine schedule); the target's embedding and LM head are
shared and frozen. The forward passes run on the PyTorch reference kernels (kernel_mode "torch"):
autograd goes through them.
"""

from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F

from ..layers import AttentionMetadata
from ..layers.backend import kernel_mode
from .eagle import EagleModel
from .medusa import MedusaHeads


@torch.no_grad()  # not inference_mode: autograd must be able to save these tensors
def target_hidden(target, sequences: list[list[int]], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [n], h [n, hidden]) of every sequence: the target's dense forward, no cache."""
    out = []
    for ids in sequences:
        x = torch.tensor(ids, device=device)
        meta = AttentionMetadata.from_seq_lens([len(ids)], device)
        out.append((x, target(x, torch.arange(len(ids), device=device), meta).clone()))  # [n], [n, hidden]
    return out


def soft_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[N, V] each -> mean over rows of -sum p_teacher log p_student."""
    p = teacher_logits.float().softmax(-1)
    return -(p * student_logits.float().log_softmax(-1)).sum(-1).mean()


def medusa_loss(heads: MedusaHeads, target, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One sequence: head j predicts the target's distribution at t+1+j from h_t."""
    n, losses = h.shape[0], []
    with torch.no_grad():
        teacher = target.compute_logits(h)  # [n, V]
    for j, block in enumerate(heads.blocks):
        m = n - 1 - j  # positions t with a row t+1+j
        if m <= 0:
            break
        x = block(h[:m])  # [m, hidden]
        logits = target.compute_logits(x) if heads.lm_heads is None else heads.lm_heads[j](x)
        losses.append(soft_ce(logits, teacher[1 + j : 1 + j + m]))
    return torch.stack(losses).mean()


def eagle_loss(model: EagleModel, target, ids: torch.Tensor, h: torch.Tensor, noise: float = 0.0) -> torch.Tensor:
    """One sequence: from (x_p, h_{p-1}) the layer's g_p against h_p and the target's p_p."""
    n = h.shape[0]
    feats = torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]])  # [n, hidden]: h_{p-1}, zeros at p = 0
    if noise:
        feats = feats + (torch.rand_like(feats) - 0.5) * noise
    meta = AttentionMetadata.from_seq_lens([n], h.device)
    g = model(ids, torch.arange(n, device=h.device), meta, feats)  # [n, hidden]
    reg = F.smooth_l1_loss(g.float(), h.float())
    with torch.no_grad():
        teacher = target.compute_logits(h)  # [n, V]
    return reg + 0.1 * soft_ce(target.compute_logits(g), teacher)


def train(method: str, target, sequences: list[list[int]], *, num_heads: int = 4, steps: int = 200,
          lr: float = 1e-3, batch_size: int = 8, own_lm_head: bool = False, seed: int = 0,
          log=None, log_every: int = 25) -> tuple[torch.nn.Module, list[float]]:
    """-> (the trained MedusaHeads or EagleModel, in the target's dtype; the loss of every step)."""
    if method not in ("medusa", "eagle"):
        raise ValueError(f"train-drafter method must be 'medusa' or 'eagle', not {method!r}")
    sequences = [s for s in sequences if len(s) >= 3]
    if not sequences:
        raise ValueError("train-drafter needs sequences of at least 3 tokens")
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    torch.manual_seed(seed)
    rng = random.Random(seed)
    data = target_hidden(target, sequences, device)
    c = target.config
    with torch.device(device):
        if method == "medusa":
            drafter = MedusaHeads(c.hidden_size, c.vocab_size, num_heads, own_lm_head=own_lm_head)
            drafter.reset_parameters(target)
        else:
            drafter = EagleModel(target)
            drafter.reset_parameters()
    drafter = drafter.float()  # fp32 weights; a bf16 target's matmuls under autocast
    params = [p for p in drafter.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    losses, t0 = [], time.perf_counter()
    with kernel_mode("torch"), torch.enable_grad():
        for step in range(steps):
            batch = rng.sample(data, min(batch_size, len(data)))
            with autocast:
                loss = torch.stack([medusa_loss(drafter, target, ids, h) if method == "medusa"
                                    else eagle_loss(drafter, target, ids, h, noise=0.2)
                                    for ids, h in batch]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log is not None and (step % log_every == 0 or step == steps - 1):
                log(f"train-drafter {method}: step {step + 1}/{steps} loss {losses[-1]:.4f} "
                    f"({time.perf_counter() - t0:.0f} s)")
    for p in params:
        p.requires_grad_(False)
    return drafter.to(dtype).eval(), losses
