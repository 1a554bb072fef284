"""Chapter 01's oracle: minillm's tokenizer equals HF `tokenizers` token for token.

HF builds its tokenizer from the same GGUF file (through transformers), so both read one vocabulary
and one merge list; any difference is a difference in the algorithm.
"""

from __future__ import annotations

import json

import pytest

from minillm.tokenizer import from_tokenizer_json, load_tokenizer
from minillm.tokenizer.samples import FIXED, random_texts


def _first_mismatch(texts, ours, theirs):
    for text in texts:
        a, b = ours(text), theirs(text)
        if a != b:
            return text, a, b
    return None


def test_encode_matches_hf_on_fixed_corpus(tok, hf_tok):
    bad = _first_mismatch(FIXED, tok.encode, lambda t: hf_tok.encode(t, add_special_tokens=True))
    assert bad is None, f"first mismatch: {bad}"


def test_encode_matches_hf_on_random_unicode(tok, hf_tok, seed, comparable):
    texts = comparable(random_texts(seed))
    bad = _first_mismatch(texts, tok.encode, lambda t: hf_tok.encode(t, add_special_tokens=True))
    assert bad is None, f"seed {seed}: first mismatch {bad}"


def test_encode_matches_hf_on_a_long_document(tok, hf_tok, seed):
    import random

    rng = random.Random(seed)
    doc = "\n\n".join(rng.choice(FIXED) for _ in range(400))
    assert tok.encode(doc) == hf_tok.encode(doc)


def test_special_tokens_as_plain_text_match_hf(tok, hf_tok):
    for text in ["<|im_start|>user\nhi<|im_end|>", "x<|endoftext|>y"]:
        theirs = hf_tok(text, split_special_tokens=True)["input_ids"]
        assert tok.encode(text, allowed_special="none") == theirs


def test_decode_matches_hf(tok, hf_tok, seed):  # 5.17's decoder chain is byte-level in effect too
    import random

    rng = random.Random(seed)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]  # any ids, even split UTF-8
        assert tok.decode(ids) == hf_tok.decode(ids), ids
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True), ids


def test_round_trip(tok, seed):
    # every string round-trips once the few characters the vocabulary cannot spell are left out
    texts = FIXED + ["".join(c for c in t if tok.covers(c)) for t in random_texts(seed)]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text, text


def test_uncovered_bytes(tok, hf_tok, hf_unk_mode, seed):
    """SmolLM2's vocabulary has no token for byte 0x04 (and a few others). minillm drops such bytes,
    like llama.cpp and transformers 5.23; transformers 5.17 maps them to the unk token instead, and
    minillm does the same when told to (as a tokenizer.json with an unk token tells it)."""
    import copy

    assert 0x04 in tok.uncovered_bytes and not tok.covers("a\x04b")
    texts = ["a\x04b \x13c", "!\x04\x04!", "x\U00092987y"] + random_texts(seed, 200)
    ours = tok
    if hf_unk_mode == "unk":
        ours = copy.copy(tok)
        ours.unk_token_id, ours.fuse_unk, ours._cache = hf_tok.unk_token_id, True, {}
    bad = _first_mismatch(texts, ours.encode, hf_tok.encode)
    assert bad is None, f"{hf_unk_mode}, seed {seed}: {bad}"


def test_metadata_matches_the_file(tok, hf_tok, gguf_path):
    """Ids read straight from the GGUF header (transformers 5.17 mislabels the eos token as
    <|im_start|>, so the file itself is the oracle here)."""
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields
    assert tok.vocab_size == len(hf_tok) == len(fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert tok.eos_token_id == fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert tok.bos_token_id == fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert tok.eos_token == "<|im_end|>"
    assert len(tok.merges) == len(fields["tokenizer.ggml.merges"].contents())


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "héllo 👋 <b>bold</b>\n\nnew paragraph"}],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        hf_ids = hf_ids["input_ids"]
    assert ids == list(hf_ids)


# ---- tokenizer.json: the same vocabulary through HF's own file format, and other pre-tokenizers ----


@pytest.fixture(scope="module")
def hf_dir(hf_tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf_tok.save_pretrained(folder)
    return folder


def test_tokenizer_json_folder_matches_hf(hf_dir, hf_tok, seed):
    # the file HF writes spells out its unk handling, so here uncovered bytes match in every version
    ours = load_tokenizer(hf_dir)
    texts = FIXED + random_texts(seed, 200)
    bad = _first_mismatch(texts, ours.encode, lambda t: hf_tok.encode(t))
    assert bad is None, f"seed {seed}: {bad}"
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


LLAMA3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": None}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


def _variants():
    from minillm.tokenizer import LLAMA3, QWEN2

    llama3 = json.loads(json.dumps(LLAMA3_PRE))
    llama3["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3
    qwen2 = json.loads(json.dumps(LLAMA3_PRE))
    qwen2["pretokenizers"][0]["pattern"]["Regex"] = QWEN2
    digits = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    bos = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
           {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
           "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    bos_eos = json.loads(json.dumps(bos))
    bos_eos["single"].append({"SpecialToken": {"id": "<|im_end|>", "type_id": 0}})
    bos_eos["special_tokens"]["<|im_end|>"] = {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}
    llama3_post = {"type": "Sequence", "processors": [  # Llama 3's own layout: ByteLevel, then the template
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}, bos]}
    return {
        "bos-eos-template": {"post_processor": bos_eos},
        "llama3-sequence-post": {"pre_tokenizer": llama3, "post_processor": llama3_post},
        "llama3-split": {"pre_tokenizer": llama3},
        "qwen2-split-nfc": {"pre_tokenizer": qwen2, "normalizer": {"type": "NFC"}},
        "smollm-digits": {"pre_tokenizer": digits},
        "bos-template": {"post_processor": bos},
    }


@pytest.mark.parametrize("variant", list(_variants()))
def test_tokenizer_json_variants_match_hf_tokenizers(hf_dir, variant, seed, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    spec.update(_variants()[variant])
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    oracle = HFTokenizer.from_file(str(path))
    ours = from_tokenizer_json(path)
    texts = FIXED + random_texts(seed, 150)
    bad = _first_mismatch(texts, ours.encode, lambda t: oracle.encode(t).ids)
    assert bad is None, f"{variant}, seed {seed}: {bad}"
    bad = _first_mismatch(texts, lambda t: ours.encode(t, add_special_tokens=False),
                          lambda t: oracle.encode(t, add_special_tokens=False).ids)
    assert bad is None, f"{variant} without special tokens, seed {seed}: {bad}"
