"""An EAGLE draft layer (Li et al. 2024, arXiv:2401.15077): one decoder layer over the target's features.

EAGLE drafts at the level of features, not tokens. At position p it reads the target's hidden state
of the position before and the embedding of the token at p,

    x_p = fc(concat(embed(t_p), h_{p-1}))        [T, 2 hidden] -> [T, hidden]    (h_{-1} = 0)
    g_p = norm(layer(x_p))                        one decoder layer of the target's shape, causal
    logits_p = target.lm_head(g_p)                its guess at token p+1

and g_p, its guess at the target's own h_p, is what the next position reads in place of h_p while it
drafts autoregressively: draft j+1 comes from (g_{n-2+j}, draft j) at position n-1+j. The embedding and
the LM head are the target's (frozen and shared); the draft's own weights are fc, the layer and a norm
(a few % of a small target's).

Its layer has a paged KV cache of its own with the target's block ids (draft_model.py's scheme: the
block manager's allocation, preemption and copy-on-write serve both). Position p's K/V depend on h_{p-1},
so they are true only when written from the target's h: `drafted` counts positions up to the last
token's (n - 1) as computed, and the next proposal first recomputes the positions the verify accepted,
now from the target's own hidden states, which the worker kept (worker/hidden_states.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..cache import PagedKVCache, kv_cache_spec
from ..forward_context import get_forward_context
from ..layers.layernorm import RMSNorm
from ..layers.linear import ReplicatedLinear
from ..models.llama import LlamaDecoderLayer
from ..worker.model_input import pack
from ..worker.model_runner import forward_packed
from .drafter_files import load_into, read_drafter
from .proposer import Proposer, new_tokens, sample_drafts  # new_tokens: the one recorded Sequence edge

FEATURES = "eagle_features"  # the forward context's extra: [T, hidden] h_{p-1} for every token


class EagleModel(nn.Module):
    def __init__(self, target):
        super().__init__()
        tc = target.config
        body = getattr(target, "model", None)
        if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb")):
            raise ValueError(f"speculative_config method 'eagle' needs a Llama-shaped target (model.embed_tokens, "
                             f".rotary_emb); {type(target).__name__} is not one")
        H = tc.hidden_size
        self.config = {"method": "eagle", "hidden_size": H, "vocab_size": tc.vocab_size,
                       "num_heads": tc.num_heads, "num_kv_heads": tc.num_kv_heads, "head_dim": tc.head_dim,
                       "intermediate_size": tc.intermediate_size}
        layer_config = dataclasses.replace(tc, num_layers=1, sliding_windows=[None])
        self.fc = ReplicatedLinear(2 * H, H)
        self.layer = LlamaDecoderLayer(layer_config, 0, prefix="layers.0")
        self.norm = RMSNorm(H, tc.rms_norm_eps)
        self._target = [target]  # shared, not a submodule: not saved, no KV-cache layer of ours

    @property
    def target(self):
        return self._target[0]

    def reset_parameters(self, std: float = 0.02) -> None:
        """A fresh layer: linear weights N(0, std), biases 0, norms 1 (train_drafter.py starts here)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)

    def forward(self, input_ids, positions, attn_metadata, features: torch.Tensor | None = None):
        """input_ids, positions [T]; features [T, hidden] (h_{p-1} per token; default: the forward
        context's extras[FEATURES]) -> g [T, hidden], the draft's guess at the target's h."""
        if features is None:
            features = get_forward_context().extras[FEATURES]
        body = self.target.model
        e = body.embed_tokens(input_ids)  # [T, hidden]
        x = self.fc(torch.cat([e, features.to(e.dtype)], dim=-1))  # [T, 2 hidden] -> [T, hidden]
        cos_sin = body.rotary_emb.cos_sin(positions, x.dtype)
        x, residual = self.layer(positions, x, None, attn_metadata, cos_sin)
        x, _ = self.norm(x, residual)
        return x  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)  # [N, vocab] fp32, the target's LM head


def load_eagle(config, target) -> EagleModel:
    """The draft layer a speculative_config names: a saved folder (drafter_files.py) or a built EagleModel."""
    param = next(target.parameters())
    model = config.model
    if not isinstance(model, EagleModel):
        saved, tensors = read_drafter(model, "eagle", target.config)
        with torch.device(param.device):
            model = EagleModel(target)
        for key, value in model.config.items():
            if saved.get(key) != value:
                raise ValueError(f"speculative_config model {str(config.model)!r}: the EAGLE layer's {key} is "
                                 f"{saved.get(key)}, the target's {value}")
        load_into(model, tensors, f"eagle layer {str(config.model)!r}")
    elif model.target is not target:
        raise ValueError("speculative_config model: this EagleModel was built for another target model")
    return model.to(device=param.device, dtype=param.dtype).eval()


class EagleProposer(Proposer):
    method = "eagle"

    def __init__(self, model: EagleModel, block_size: int, sizes):
        self.model, self.block_size, self.device = model, block_size, sizes.device
        self.cache = PagedKVCache(kv_cache_spec(model), sizes.num_gpu_blocks, block_size, sizes.device)
        self.cache.bind(model)
        self.hidden_states = None  # the worker's HiddenStates (Worker.attach_proposer)

    def copy_blocks(self, pairs):
        self.cache.copy_blocks(pairs)

    def catch_up(self, seq) -> tuple[int, torch.Tensor] | None:
        """The first position the layer runs at and the features [n - start, hidden] (h_{start-1} ..
        h_{n-2}) from the worker; None when it holds not even h_{n-2}."""
        n = seq.num_tokens
        start = min(seq.num_draft_computed, n - 1)
        lo = max(start, 1) - 1
        got, h = self.hidden_states.gather(seq.seq_id, lo, n - 2)
        if h is None:
            return None
        if start == 0 and got == 0:  # position 0 has no h before it: zeros
            return 0, torch.cat([h.new_zeros(1, h.shape[1]), h])
        return got + 1, h

    @torch.inference_mode()
    def propose(self, seqs, num_spec, tables):
        self.cache.bind(self.model)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active, chunks, feats = [], [], []
        for i, k in enumerate(num_spec):
            got = self.catch_up(seqs[i]) if k > 0 else None
            if got is None:
                continue
            s, (start, h) = seqs[i], got
            active.append(i)
            chunks.append((start, new_tokens(s, start, s.num_tokens - start), tables.row(s.seq_id)))
            feats.append(h)
        rows = {seqs[i].seq_id: c[2] for i, c in zip(active, chunks)}
        any_random = any(seqs[i].params.temperature > 0 for i in active)
        features = torch.cat(feats) if feats else None  # [T, hidden]
        while active:
            lens = [len(c[1]) for c in chunks]
            last = torch.tensor(lens).cumsum(0).sub(1).tolist()  # each chunk's last row
            step = pack(chunks, self.block_size, last)
            logits, g = forward_packed(self.model, self.device, step, extras={FEATURES: features},
                                       return_hidden=True)  # [A, V], [T, hidden]
            g = g[torch.tensor(last, device=g.device)]  # [A, hidden]: the guesses at h of each last token
            act = [seqs[i] for i in active]
            tokens, q = sample_drafts(logits, act, [len(drafts[i]) for i in active], any_random)
            keep = []
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None:
                    qs[i].append(q[row])
                if len(drafts[i]) < num_spec[i]:
                    keep.append(row)
            active = [active[r] for r in keep]
            # the next pass: draft j at position n - 1 + j, reading g of the position before it
            chunks = [(seqs[i].num_tokens - 1 + len(drafts[i]), drafts[i][-1:], rows[seqs[i].seq_id])
                      for i in active]
            features = g[torch.tensor(keep, device=g.device)] if keep else None  # [A', hidden]
        for s, d in zip(seqs, drafts):
            if d:  # positions < n were written from the target's h; the drafts' from guesses
                s.num_draft_computed = s.num_tokens
        probs = torch.stack([q for row in qs for q in row]) if any_random and any(qs) else None  # [D, V]
        return drafts, probs
