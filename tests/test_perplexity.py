"""Perplexity (minillm/eval/perplexity.py) against Hugging Face's loss-based perplexity.

The oracle is HF's recipe written out here on its own: sliding windows by `range(0, N, stride)`,
labels of the already-scored tokens set to -100, the model's mean `loss` times its number of scored
labels, summed and exponentiated; on a tiny random llama checkpoint and on the embedded SmolLM2
(both fp32 on a CPU, the same token ids on both sides).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_corpus import corpus  # noqa: F401  (fixture)
from tiny_models import VOCAB, hf_model, make_tiny

from minillm import LLM
from minillm.eval import perplexity, windows
from minillm.loader import load_model


def hf_perplexity(hf, ids: list[int], context_len: int, stride: int) -> float:
    x = torch.tensor([ids])
    total, count, prev_end = 0.0, 0, 0
    with torch.inference_mode():
        for begin in range(0, len(ids), stride):
            end = min(begin + context_len, len(ids))
            labels = x[:, begin:end].clone()
            labels[:, :-(end - prev_end)] = -100  # scored by an earlier window
            n = int((labels[:, 1:] != -100).sum())  # HF shifts: the first label predicts nothing
            total += hf(x[:, begin:end], labels=labels).loss.double().item() * n
            count += n
            prev_end = end
            if end == len(ids):
                break
    return math.exp(total / count)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny("llama3", tmp_path_factory.mktemp("ppl"))
    return load_model(folder)[0], hf_model(folder)


def test_windows_score_every_token_once(seed):
    rng = random.Random(seed)
    for _ in range(200):
        n, ctx = rng.randint(2, 300), rng.randint(2, 64)
        stride = rng.randint(1, ctx)
        spans = windows(n, ctx, stride)
        scored = [t for _, e, first in spans for t in range(first, e)]
        unscored = range(stride, n, stride) if stride == ctx else []  # each window's first: no context in it
        assert scored == sorted(set(range(1, n)) - set(unscored))
        for b, e, first in spans:
            assert e - b <= ctx and b < first < e + 1
            if b > 0:  # after the first window every scored token sees at least max(ctx - stride, 1) earlier
                assert first - b >= max(ctx - stride, 1)


@pytest.mark.parametrize("context_len,stride", [(32, 16), (32, 32), (24, 7), (256, 256)])
def test_tiny_model_matches_hf(tiny, seed, context_len, stride):
    model, hf = tiny
    ids = [random.Random(seed).randrange(VOCAB) for _ in range(101)]
    ours = perplexity(model, ids, context_len=context_len, stride=stride, batch_tokens=64, use_tqdm=False)
    assert ours.num_tokens == 100 - (len(windows(101, context_len, stride)) - 1 if stride == context_len else 0)
    assert ours.perplexity == pytest.approx(hf_perplexity(hf, ids, context_len, stride), rel=1e-5)
    if context_len >= len(ids):  # one window: HF's plain loss
        with torch.inference_mode():
            loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
        assert ours.nll == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
def test_embedded_model_matches_hf(corpus, gguf_path):  # noqa: F811
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32).eval()
    llm = LLM(dtype="float32", device="cpu", enable_kv_cache=False)
    ids = llm.tokenizer.encode(corpus.eval_text())[:200]
    ours = perplexity(llm, ids, context_len=96, stride=48, use_tqdm=False)
    theirs = hf_perplexity(hf, ids, 96, 48)
    assert ours.perplexity == pytest.approx(theirs, rel=1e-4)
    assert 2 < ours.perplexity < 100  # English prose under a small English model
    # the text path tokenizes the same way; max_tokens cuts the same prefix
    text_result = perplexity(llm, corpus.eval_text(), context_len=96, stride=48, max_tokens=200, use_tqdm=False)
    assert text_result == ours


def test_bad_inputs(tiny):
    model, _ = tiny
    ids = list(range(50))
    for kwargs, match in [(dict(context_len=1), "context_len"), (dict(context_len=10**6), "context_len"),
                          (dict(context_len=8, stride=9), "stride"), (dict(stride=0), "stride"),
                          (dict(max_tokens=1), "max_tokens"), (dict(batch_tokens=0), "batch_tokens")]:
        with pytest.raises(ValueError, match=match):
            perplexity(model, ids, use_tqdm=False, **kwargs)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [3], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        perplexity(model, [1, VOCAB], use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        perplexity(model, "text", use_tqdm=False)
    with pytest.raises(TypeError, match="str or a list of token ids"):
        perplexity(model, torch.tensor(ids), use_tqdm=False)
    with pytest.raises(TypeError, match="LLM or a minillm model"):
        perplexity("model", ids, use_tqdm=False)
