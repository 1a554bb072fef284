"""Chapter 02's oracle: minillm's forward pass gives Hugging Face transformers' logits, and greedy
decoding gives its tokens, for the embedded SmolLM2 (both loading the same GGUF) and for tiny
random checkpoints of every supported family (loaded through the HF-folder path)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import FAMILIES, VOCAB, hf_model, make_tiny

from minillm import LLM, SamplingParams
from minillm.layers import AttentionMetadata
from minillm.loader import load_model

ATOL_FP32 = 1e-3  # on logits of magnitude ~10-30; measured differences are ~1e-4
GREEDY_STEPS = 64


def _packed_logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """All logits of several sequences run as ONE packed batch: exercises cu_seqlens and masking."""
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata.from_seq_lens(lens)
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, meta))
    return list(logits.split(lens))


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    # min_new_tokens keeps EOS out, as our min_tokens does: both produce exactly `steps` tokens
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
    return out[0, len(ids):].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_STEPS, min_tokens=GREEDY_STEPS)


# ---- the embedded SmolLM2, from its GGUF file --------------------------------------------------


@pytest.fixture(scope="module")
def smollm_hf(gguf_path):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm():
    return LLM(dtype="float32", device="cpu")


@pytest.mark.slow
def test_smollm2_logits_match_hf(smollm, smollm_hf, seed):
    rng = random.Random(seed)
    tok = smollm.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    seqs = [chat, [rng.randrange(49152) for _ in range(rng.randint(5, 40))], [rng.randrange(49152)]]
    for ours, ids in zip(_packed_logits(smollm.model, seqs), seqs):
        theirs = _hf_logits(smollm_hf, ids)
        assert (ours - theirs).abs().max().item() < ATOL_FP32


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm, smollm_hf):
    prompt = smollm.tokenizer.encode(
        smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}]))
    ours = smollm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    assert ours == _hf_greedy(smollm_hf, prompt, GREEDY_STEPS)


@pytest.mark.slow
def test_smollm2_answers_sensibly(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


@pytest.mark.slow
def test_smollm2_bf16_within_tolerance(smollm_hf, seed):
    """bf16 weights and activations: the logits move, by a stated amount, and the top token rarely."""
    model, _, tok = load_model(None, dtype=torch.bfloat16)
    rng = random.Random(seed)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3) + [rng.randrange(49152) for _ in range(20)]
    (ours,) = _packed_logits(model, [ids])
    theirs = _hf_logits(smollm_hf, ids)
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    # measured on CPU: relative error 0.015-0.016, top-1 agreement 94-96 % (3 seeds, 2026-11-22)
    assert rel < 0.05, rel
    assert agree > 0.85, agree


# ---- tiny random checkpoints of every family, through the HF-folder loader ---------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    folder = make_tiny(family, tmp_path_factory.mktemp(family), max_shard_size="100KB" if family == "llama3" else None)
    return family, folder, hf_model(folder)


def test_tiny_logits_match_hf(tiny, seed):
    family, folder, hf = tiny
    model, _, _ = load_model(folder)
    rng = random.Random(seed)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (rng.randint(20, 60), 1, rng.randint(2, 19))]
    for ours, ids in zip(_packed_logits(model, seqs), seqs):
        theirs = _hf_logits(hf, ids)
        assert (ours - theirs).abs().max().item() < ATOL_FP32, family


@pytest.mark.slow
def test_tiny_greedy_matches_hf(tiny, seed):
    family, folder, hf = tiny
    llm = LLM(folder, dtype="float32", device="cpu")
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(12)]
    ours = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == _hf_greedy(hf, prompt, GREEDY_STEPS), family


def test_sharded_checkpoint_was_sharded(tiny):
    family, folder, _ = tiny
    if family == "llama3":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the GPU machine)")
def test_smollm2_on_cuda_matches_hf(smollm_hf):
    """The same model on the GPU, fp32: logits within tolerance, greedy tokens identical to HF there."""
    llm = LLM(dtype="float32", device="cuda")
    hf = smollm_hf.to("cuda")
    try:
        tok = llm.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))
        (ours,) = _packed_logits_on(llm.model, [prompt], "cuda")
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        assert (ours - theirs).abs().max().item() < ATOL_FP32
        got = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=GREEDY_STEPS,
                               min_new_tokens=GREEDY_STEPS, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want
    finally:
        smollm_hf.to("cpu")


def _packed_logits_on(model, seqs, device):
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata.from_seq_lens(lens, device)
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    with torch.inference_mode():
        return list(model.compute_logits(model(ids, pos, meta)).split(lens))
