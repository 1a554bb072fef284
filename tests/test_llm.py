"""The LLM front door: vLLM-shaped outputs, n > 1, seeds, streaming, and a clear error for every
kind of bad input (the engine keeps working after each)."""

from __future__ import annotations

import pytest
from tiny_models import VOCAB, make_tiny

from minillm import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    return LLM(make_tiny("qwen3", tmp_path_factory.mktemp("qwen3")), device="cpu")


def test_output_shape(tiny_llm):
    outs = tiny_llm.generate(["Hello world", "The end"], SamplingParams(max_tokens=5, logprobs=2, seed=1))
    assert len(outs) == 2 and all(isinstance(o, RequestOutput) for o in outs)
    o = outs[0]
    assert o.prompt == "Hello world" and o.prompt_token_ids == tiny_llm.tokenizer.encode("Hello world")
    c = o.outputs[0]
    assert len(c.token_ids) <= 5 and c.finish_reason in ("stop", "length")
    assert c.text == tiny_llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert len(c.logprobs) == len(c.token_ids)
    for t, entry in zip(c.token_ids, c.logprobs):
        assert t in entry and len(entry) >= 2  # the sampled token, plus the top 2
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_seed_gives_the_same_text_whatever_the_batch(tiny_llm):
    p1 = SamplingParams(max_tokens=12, seed=42, temperature=1.0, ignore_eos=True)
    p3 = SamplingParams(n=3, max_tokens=12, seed=42, temperature=1.0, ignore_eos=True)
    alone = tiny_llm.generate("Once upon a time", p1)[0].outputs[0].token_ids
    again = tiny_llm.generate(["Once upon a time", "something else"], [p1, p3])[0].outputs[0].token_ids
    in_batch = tiny_llm.generate("Once upon a time", p3)[0].outputs
    assert alone == again == in_batch[0].token_ids  # completion 0 shares the request's seed
    assert len({tuple(c.token_ids) for c in in_batch}) > 1  # the n completions differ
    assert [c.index for c in in_batch] == [0, 1, 2]


def test_stream_equals_generate(tiny_llm):
    p = SamplingParams(max_tokens=10, seed=7, temperature=0.8)
    streamed = "".join(tiny_llm.stream("Hello", p))
    assert streamed == tiny_llm.generate("Hello", p)[0].outputs[0].text


@pytest.mark.slow
def test_chat_uses_the_template():
    llm_out = LLM(device="cpu").chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))
    assert llm_out[0].prompt.startswith("<|im_start|>system") and llm_out[0].prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("prompts,params,err,match", [
    ("", None, ValueError, r"prompts\[0\] is empty"),
    ([], None, ValueError, "non-empty list"),
    ([42], None, TypeError, r"prompts\[0\] must be a str"),
    ({"prompt_token_ids": [1, VOCAB + 5]}, None, ValueError, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, None, TypeError, "list of ints"),
    ("hi", {"temperature": 0}, TypeError, "must be a SamplingParams"),
    (["a", "b"], [SamplingParams()], ValueError, "got 1 sampling_params for 2 prompts"),
    ("word " * 300, SamplingParams(max_tokens=4), ValueError, "context is 256 tokens"),
])
def test_bad_requests_are_clear_errors_and_the_engine_goes_on(tiny_llm, prompts, params, err, match):
    with pytest.raises(err, match=match):
        tiny_llm.generate(prompts, params)
    assert tiny_llm.generate("still serving", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_bad_model_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model or tokenizer at"):
        LLM(tmp_path / "missing.gguf", device="cpu")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ValueError, match="not a readable GGUF"):
        LLM(bad, device="cpu")
    with pytest.raises(ValueError, match="dtype must be"):
        LLM(dtype="float8", device="cpu")
    with pytest.raises(ValueError, match="device must be"):
        LLM(device="tpu")


def test_truncated_and_corrupt_checkpoints(tmp_path, gguf_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[: 60_000_000])  # the header is whole, the tensors are not
    with pytest.raises(ValueError, match="GGUF"):
        LLM(cut, device="cpu")
    folder = make_tiny("llama2-tied", tmp_path / "tiny")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # truncated
    with pytest.raises(ValueError, match="not a readable safetensors"):
        LLM(folder, device="cpu")
    weights.write_bytes(b"\x00" * 64)  # garbage
    with pytest.raises(ValueError, match="not a readable safetensors"):
        LLM(folder, device="cpu")
    weights.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="pickle files are not loaded"):
        LLM(folder, device="cpu")
