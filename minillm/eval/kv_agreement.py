"""How much a quantized KV cache changes what a model generates: free-running greedy agreement.

    from minillm import LLM
    from minillm.eval.kv_agreement import kv_greedy_agreement
    for r in kv_greedy_agreement(LLM(dtype="float32", device="cpu")):
        print(r.kv_cache_dtype, r.same_position, r.first_divergence)

Each prompt is generated greedily for `max_tokens` tokens twice through the engine, once with the
model's own cache dtype ("auto": the reference) and once with an fp8/int8 cache, and the two token
lists are compared position by position. Free-running is the strict test: the first token that
differs changes the context of every token after it, so the two generations usually part for good.
That is why each prompt's **first divergence** is reported too, with the reference's margin there:
log p(top token) - log p(runner-up), in nats. A small margin is a near-tie that any rounding of the
cache can flip, a cache of bf16 numbers included: with an fp32 model the measurement also runs that
control (K and V rounded to bf16 before they are cached: what a two-byte cache would hold), so the
one-byte caches' numbers have something to stand beside.

Beside it, the gentler teacher-forced measures on the same texts: each prompt followed by the
reference's own 64 tokens goes through one prefill over a cache of each dtype (every key and value
written to the cache and read back, as in decode), and at each position the greedy choice is compared
with the reference's token and the next-token distribution with the reference's (mean KL divergence,
nats): the same context everywhere, so a flip no longer carries over to what follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PagedKVCache, kv_cache_spec
from ..engine import EngineConfig, LLMEngine
from ..layers.attention import Attention, AttentionMetadata
from ..layers.quantization.kv_cache import calibrate_kv_scales, calibration_prompts, kv_cache_torch_dtype
from ..sampling import SamplingParams

# Eight short instructions of different kinds (none of them calibration text), through the chat template.
PROMPTS = ["The capital of France is", "Write a haiku about autumn.", "What is 12 times 7?",
           "Explain what a KV cache is in one paragraph.", "List three colors of the rainbow.",
           "def fibonacci(n):", "Once upon a time, in a small village,", "Translate 'good morning' into Spanish."]
BF16_CONTROL = "bf16 (control)"


@dataclass(frozen=True)
class KVAgreement:
    kv_cache_dtype: str  # "fp8", "int8", or BF16_CONTROL
    tokens: int  # generated tokens compared (prompts x max_tokens)
    same_position: float  # fraction of positions where the token equals the reference's
    before_first_divergence: float  # fraction of tokens generated before each prompt's first difference
    first_divergence: list[int]  # per prompt: index of the first token that differs (max_tokens: none did)
    divergence_margin: list[float | None]  # per prompt: the reference's top-1 minus top-2 logprob there
    teacher_forced_same: float  # the reference's texts fed in: fraction of greedy choices equal to its tokens
    teacher_forced_kl: float  # ... and the mean KL(reference || this cache) of the next-token distributions

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def kv_greedy_agreement(llm, kv_cache_dtypes=("fp8", "int8"), prompts: list[str] = PROMPTS,
                        max_tokens: int = 64, per_channel_keys: bool = True) -> list[KVAgreement]:
    """Greedy generations of `prompts` with each of `kv_cache_dtypes` vs the model's own cache dtype.
    `llm`: an LLM (its model, tokenizer and EOS ids are used; engines of its own are built here, and
    its attention layers' KV scales are calibrated on its tokenizer's text, as LLM does;
    per_channel_keys=False calibrates one key scale per head instead, for comparison; the layers keep
    the scales of the last dtype measured)."""
    for name in kv_cache_dtypes:
        if kv_cache_torch_dtype(name) is None:
            raise ValueError(f"kv_cache_dtypes are compared with the model's own cache dtype ('auto'); give "
                             f"quantized ones ('fp8', 'fp8_e4m3', 'int8'), not {name!r}")
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of non-empty strings, got {prompts!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, not {max_tokens!r}")
    model, tok = llm.model, llm.tokenizer
    model_dtype = next(model.parameters()).dtype
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts]
    reference, top2 = _generate(llm, ids, "auto", max_tokens)
    texts = [p + r for p, r in zip(ids, reference)]  # the reference's texts, for the teacher-forced measures
    ref_logits = [cached_logits(model, t, model_dtype)[len(p) - 1:-1] for p, t in zip(ids, texts)]  # [max_tokens, V]
    results = []
    if model_dtype == torch.float32:  # a bf16 model's own cache is the control
        hooks = [m.register_forward_pre_hook(_round_kv_to_bf16) for m in model.modules() if isinstance(m, Attention)]
        try:
            got = _generate(llm, ids, "auto", max_tokens)[0]
            logits = [cached_logits(model, t, model_dtype)[len(p) - 1:-1] for p, t in zip(ids, texts)]
        finally:
            for h in hooks:
                h.remove()
        results.append(_compare(BF16_CONTROL, got, reference, top2, logits, ref_logits))
    for name in kv_cache_dtypes:
        dtype = kv_cache_torch_dtype(name)
        calibrate_kv_scales(model, calibration_prompts(tok), dtype, per_channel_keys=per_channel_keys)
        got = _generate(llm, ids, name, max_tokens)[0]
        logits = [cached_logits(model, t, dtype)[len(p) - 1:-1] for p, t in zip(ids, texts)]
        results.append(_compare(name, got, reference, top2, logits, ref_logits))
    return results


@torch.inference_mode()
def cached_logits(model, ids: list[int], dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] (fp32) of one prefill through a paged cache of `dtype` (the model's own,
    or fp8/int8 with its calibrated scales): every key and value is written to the cache and read
    back from it, as in decode."""
    device = next(model.parameters()).device
    T = len(ids)
    cache = PagedKVCache(kv_cache_spec(model, dtype), -(-T // block_size) + 1, block_size, device)
    cache.bind(model)
    try:
        meta = AttentionMetadata.from_seq_lens([T], device)
        meta.seq_lens = torch.tensor([T], dtype=torch.int32, device=device)
        table = torch.randperm(cache.num_blocks - 1, device=device) + 1  # shuffled, block 0 unused
        meta.block_table = table.int()[None]
        pos = torch.arange(T, device=device)
        meta.slot_mapping = table[pos // block_size] * block_size + pos % block_size
        return model.compute_logits(model(torch.tensor(ids, device=device), pos, meta)).float()
    finally:
        cache.unbind(model)


def _generate(llm, ids: list[list[int]], kv_cache_dtype: str, max_tokens: int):
    """Greedy tokens [prompt][max_tokens] and the reference's top-2 logprobs at each of them."""
    blocks = sum(-(-(len(p) + max_tokens) // 16) for p in ids) + 1  # every request at once, block 0 spare
    engine = LLMEngine(llm.model, llm.tokenizer, llm.eos_token_ids,
                       EngineConfig(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=blocks, max_num_seqs=len(ids)))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, p in enumerate(ids):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    outs = [done[str(i)] for i in range(len(ids))]
    del engine  # its cache, before the next engine sizes one
    top2 = [[sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in o.logprobs] for o in outs]
    return [list(o.token_ids) for o in outs], top2


def _compare(name: str, got, reference, top2, logits, ref_logits) -> KVAgreement:
    max_tokens = len(reference[0])
    same = sum(x == y for g, r in zip(got, reference) for x, y in zip(g, r))
    first = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), max_tokens) for g, r in zip(got, reference)]
    margins = [None if i == max_tokens else top2[p][i][0] - top2[p][i][1] for p, i in enumerate(first)]
    total = len(reference) * max_tokens
    lq, lr = torch.cat(logits).log_softmax(-1), torch.cat(ref_logits).log_softmax(-1)  # [total, V]
    tf_same = (lq.argmax(-1) == torch.tensor([t for r in reference for t in r], device=lq.device)).float().mean()
    kl = torch.nn.functional.kl_div(lq, lr, log_target=True, reduction="batchmean")  # KL(reference || this)
    return KVAgreement(name, total, same / total, sum(first) / total, first, margins, tf_same.item(), kl.item())


def _round_kv_to_bf16(layer, args):
    """Forward pre-hook of an attention layer: K and V as a bf16 cache would hold them."""
    q, k, v, *rest = args  # k, v: [T, Hkv, D]
    return (q, k.bfloat16().to(k.dtype), v.bfloat16().to(v.dtype), *rest)
