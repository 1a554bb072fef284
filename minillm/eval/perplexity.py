"""Perplexity: how surprised a model is by a text, the number that says what quantization cost.

    from minillm.eval import perplexity
    r = perplexity(LLM(quantization="int4"), corpus.eval_text(), context_len=512, max_tokens=8192)
    r.perplexity, r.nll, r.num_tokens

For tokens t_1..t_N, perplexity = exp(-(1/n) * sum_i log p(t_i | the tokens before t_i)) over the n
tokens that are scored: every token but the first. It is the exponent of the mean cross-entropy in
nats, so 1.0 is a model that is certain and right, and a model guessing uniformly over V tokens gets V.

A text longer than the model's context is scored in **sliding windows** (Hugging Face's recipe): a
window of `context_len` tokens advances by `stride`; each window scores only the tokens no earlier
window scored (its last `stride` or so), and uses the tokens before them only as context. With
stride = context_len the windows are disjoint and the first tokens of each have little context (a
pessimistic number); a smaller stride gives each scored token at least context_len - stride tokens
of context, at context_len / stride times the compute. (With stride = context_len the first token
of each window has no context at all and is not scored, as in HF's recipe.) The average is exact and token-weighted:
the NLLs of all scored tokens are summed (in fp64) and divided by their count, so windows of
different lengths weigh what their tokens weigh (HF's guide averages per-window means instead).

Windows run through the model's own packed forward (one `AttentionMetadata` with several
sequences, no KV cache), up to `batch_tokens` tokens at a time (default: one window on a CPU, 8 on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..checks import check_int
from ..layers import AttentionMetadata


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    num_tokens: int  # tokens scored (all but the first; with disjoint windows, all but each window's first)
    context_len: int
    stride: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def windows(num_tokens: int, context_len: int, stride: int) -> list[tuple[int, int, int]]:
    """[(begin, end, first_scored)]: window tokens[begin:end] scores tokens first_scored..end-1 (indices
    into the text, the ones no earlier window scored); together they score tokens 1..N-1 once each,
    except, when stride = context_len, the first token of each window."""
    out, scored_to, begin = [], 0, 0
    while scored_to < num_tokens:
        end = min(begin + context_len, num_tokens)
        # A window's first token has no context inside it: it is never scored (token 0 of the text,
        # and with stride = context_len each window's first token, as in HF's recipe).
        first = max(scored_to, begin + 1)
        if first < end:
            out.append((begin, end, first))
        scored_to = end
        begin += stride
    return out


def _resolve(model_or_llm, tokenizer):
    """An LLM (its model and tokenizer) or a bare model (then text must be token ids or a tokenizer given)."""
    # an LLM holds its model in .model; so does a LlamaForCausalLM (its decoder stack), hence the order
    model = model_or_llm if hasattr(model_or_llm, "compute_logits") else getattr(model_or_llm, "model", None)
    tokenizer = tokenizer if tokenizer is not None else getattr(model_or_llm, "tokenizer", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "compute_logits"):
        raise TypeError(f"perplexity needs an LLM or a minillm model, not {type(model_or_llm).__name__}")
    return model, tokenizer


def perplexity(model_or_llm, text, *, context_len: int | None = None, stride: int | None = None,
               max_tokens: int | None = None, tokenizer=None, batch_tokens: int | None = None,
               use_tqdm: bool = True) -> PerplexityResult:
    """Perplexity of `text` (a str, or a list of token ids) under a model or an LLM.

    context_len: window length (default: the model's max_position_embeddings, at most 1024);
    stride: how far a window moves (default context_len // 2); max_tokens: score only the first
    max_tokens tokens of the text (None: all)."""
    model, tokenizer = _resolve(model_or_llm, tokenizer)
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError("text is a str but the model has no tokenizer: pass tokenizer= or token ids")
        ids = tokenizer.encode(text)
    elif isinstance(text, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        ids = list(text)
    else:
        raise TypeError(f"text must be a str or a list of token ids, not {type(text).__name__}")
    max_pos = model.config.max_position_embeddings
    context_len = min(max_pos, 1024) if context_len is None else context_len
    check_int("context_len", context_len, 2)
    if context_len > max_pos:
        raise ValueError(f"context_len must be at most the model's {max_pos} positions, not {context_len}")
    stride = max(1, context_len // 2) if stride is None else stride
    check_int("stride", stride, 1)
    if stride > context_len:
        raise ValueError(f"stride must be at most context_len ({context_len}), not {stride}: tokens between "
                         f"windows would never be scored")
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, 2)
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"text must have at least 2 tokens to score one, got {len(ids)}")
    vocab = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"token ids must lie in 0..{vocab - 1}")
    device = next(model.parameters()).device
    # A CPU computes packed attention densely over all T tokens of a batch (T^2 work): one window at a
    # time there. The GPU kernels skip other sequences' tiles, and bigger batches keep them busy.
    if batch_tokens is None:
        batch_tokens = 8 * context_len if device.type == "cuda" else context_len
    check_int("batch_tokens", batch_tokens)  # a batch holds at least one window, whatever its length
    tokens = torch.tensor(ids, device=device)  # [N]
    spans = windows(len(ids), context_len, stride)
    total_nll, count = 0.0, 0
    with torch.inference_mode(), tqdm(total=len(ids) - 1, desc="perplexity", unit="tok", disable=not use_tqdm) as bar:
        batch: list[tuple[int, int, int]] = []
        for i, span in enumerate(spans):
            batch.append(span)
            if i + 1 < len(spans) and sum(e - b for b, e, _ in batch) + context_len <= batch_tokens:
                continue
            nll, n = _score(model, tokens, batch)
            total_nll, count = total_nll + nll, count + n
            bar.update(n)
            batch = []
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, count, context_len, stride)


def _score(model, tokens: torch.Tensor, spans: list[tuple[int, int, int]]) -> tuple[float, int]:
    """Sum of -log p over the scored tokens of several windows, run as one packed forward."""
    lens = [e - b for b, e, _ in spans]
    ids = torch.cat([tokens[b:e] for b, e, _ in spans])  # [T]
    positions = torch.cat([torch.arange(n, device=tokens.device) for n in lens])  # each window from 0
    meta = AttentionMetadata.from_seq_lens(lens, tokens.device)
    hidden = model(ids, positions, meta)  # [T, hidden]
    # The logits at window position j predict token j + 1: keep the rows whose next token is scored.
    rows, targets, offset = [], [], 0
    for b, e, first in spans:
        rows.append(torch.arange(first - b - 1, e - b - 1, device=tokens.device) + offset)
        targets.append(tokens[first:e])
        offset += e - b
    rows, targets = torch.cat(rows), torch.cat(targets)  # [n], [n]
    logits = model.compute_logits(hidden[rows])  # [n, vocab] fp32
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return float(nll.double()), int(targets.numel())
