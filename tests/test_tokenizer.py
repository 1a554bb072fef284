"""Chapter 01 beyond parity: training, the incremental detokenizer, and bad input."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from minillm.tokenizer import (
    GPT2,
    IncrementalDetokenizer,
    PreTokenizer,
    bpe,
    complete_prefix,
    count_pairs,
    from_gguf,
    load_tokenizer,
    merge_pair,
    save_tokenizer_json,
    to_tokenizer_json,
    train_bpe,
)
from minillm.tokenizer.samples import FIXED, random_texts

TRAIN_TEXT = "\n".join(FIXED * 3)


# ---- the merge loop and training -----------------------------------------------------------------


def test_merge_pair_is_left_to_right_and_non_overlapping():
    assert merge_pair([5, 5, 5], (5, 5), 9) == [9, 5]
    assert merge_pair([1, 2, 1, 2, 3], (1, 2), 7) == [7, 7, 3]
    assert merge_pair([2, 1], (1, 2), 7) == [2, 1]


def test_bpe_applies_lowest_rank_first():
    # the docstring example of bpe.py: l o w e r with (l,o)=3, (lo,w)=7, (e,r)=5
    l_, o, w, e, r, lo, low, er = range(8)
    merges = {(l_, o): (3, lo), (lo, w): (7, low), (e, r): (5, er)}
    assert bpe([l_, o, w, e, r], merges) == [low, er]
    assert bpe([w, e, r], merges) == [w, er]


def test_training_merges_the_most_frequent_pair_first():
    text = "aaabdaaabac"  # the classic: 'aa' occurs 4 times, more than any other pair
    tok = train_bpe(text, vocab_size=257)
    (pair, (rank, new_id)), = tok.merges.items()
    assert (pair, rank, new_id) == ((ord("a"), ord("a")), 0, 256)
    assert tok.vocab[256] == b"aa"


def test_training_counts_agree_with_a_plain_counter(seed):
    rng = random.Random(seed)
    words = {tuple(rng.randrange(5) for _ in range(rng.randint(1, 6))): rng.randint(1, 4) for _ in range(50)}
    expected = Counter()
    for ids, f in words.items():
        for i in range(len(ids) - 1):
            expected[ids[i], ids[i + 1]] += f
    assert count_pairs(words) == expected


def test_trained_tokenizer_round_trips_and_compresses(seed):
    tok = train_bpe(TRAIN_TEXT, vocab_size=400, special_tokens=["<|end|>"])
    assert tok.vocab_size == 400
    assert tok.special_tokens == {"<|end|>": 399}
    for text in FIXED + random_texts(seed, 100):
        assert tok.decode(tok.encode(text)) == text
    prose = FIXED[1]
    assert len(tok.encode(prose)) < 0.6 * len(prose.encode())  # merges learned on it shorten it


def test_trained_tokenizer_matches_hf_tokenizers(tmp_path, seed):
    """Our vocab + merges, saved as tokenizer.json, make HF's Rust BPE cut every text like ours."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = train_bpe(TRAIN_TEXT, vocab_size=500, special_tokens=["<|end|>"])
    oracle = HFTokenizer.from_file(str(save_tokenizer_json(tok, tmp_path / "tokenizer.json")))
    for text in FIXED + random_texts(seed, 200) + ["a<|end|>b"]:
        assert tok.encode(text) == oracle.encode(text).ids, text


def test_pre_tokenizer_loses_nothing(seed):
    pre = PreTokenizer((GPT2, r"\p{N}"), normalization=None)
    for text in FIXED + random_texts(seed, 200):
        assert "".join(pre.split(text)) == text
    assert pre.split("Hello world  42") == ["Hello", " world", " ", " ", "4", "2"]


# ---- the incremental detokenizer -----------------------------------------------------------------


def test_complete_prefix_cuts_before_an_unfinished_character():
    smile = "😀".encode()  # F0 9F 98 80
    for k in range(1, 4):
        assert complete_prefix(b"ab" + smile[:k]) == 2
    assert complete_prefix(b"ab" + smile) == 6
    assert complete_prefix("é".encode()) == 2
    assert complete_prefix(b"\x80\x80") == 2  # stray continuation bytes are let through


def test_detokenizer_pieces_join_to_decode(tok, seed):
    rng = random.Random(seed)
    # token ids whose bytes are single bytes or fragments of multi-byte characters stress the cut
    fragments = [i for i, v in enumerate(tok.vocab) if any(b >= 0x80 for b in v)]
    for _ in range(200):
        ids = [rng.choice(fragments) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 25))]
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.step(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids), ids


def test_detokenizer_never_emits_half_a_character(tok):
    text = "Grüße aus 東京 😀👩‍👩‍👧‍👦!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_detokenizer_gives_no_text_for_ids_past_the_tokenizer(tok, seed):
    """A model whose embedding is padded past its tokenizer can sample such an id: it adds no text
    (HF's decode skips ids without a token), and the known ids around it decode as without it."""
    rng = random.Random(seed)
    known = [rng.randrange(tok.vocab_size) for _ in range(20)]
    ids = list(known)
    for at in sorted(rng.sample(range(len(ids) + 1), 3), reverse=True):
        ids.insert(at, tok.vocab_size + rng.randrange(64))
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(known)


def test_detokenizer_can_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    out = "".join(detok.step(i) for i in ids) + detok.flush()
    assert out == "assistant\nHi"


# ---- bad input gets a clear error ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"bytes", 42, None, ["list"]])
def test_encode_rejects_non_str(tok, bad):
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(bad)


def test_encode_rejects_lone_surrogates(tok):
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("ok \ud800 not ok")


def test_unknown_special_token_is_named(tok):
    with pytest.raises(ValueError, match=r"unknown special token.*<\|nope\|>"):
        tok.encode("hi", allowed_special={"<|im_start|>", "<|nope|>"})
    with pytest.raises(ValueError, match="allowed_special must be"):
        tok.encode("hi", allowed_special="some")
    with pytest.raises(ValueError, match="not a token"):
        tok.token_to_id("<|nope|>")


def test_allowed_special_subset(tok):
    ids = tok.encode("<|im_start|>x<|im_end|>", allowed_special={"<|im_start|>"})
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") not in ids


@pytest.mark.parametrize("ids,err", [([1, 2, 10**6], ValueError), ([1, -1], ValueError), ([1.5], TypeError),
                                     ("abc", TypeError)])
def test_decode_rejects_bad_ids(tok, ids, err):
    with pytest.raises(err, match="token id"):
        tok.decode(ids)


def test_decode_accepts_tensors(tok):
    torch = pytest.importorskip("torch")
    ids = tok.encode("tensor input")
    assert tok.decode(torch.tensor(ids)) == "tensor input"


@pytest.mark.parametrize("messages,match", [
    ("hi", "messages must be a list"),
    ([], "messages is empty"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\]\['role'\]"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a str"),
    (["hi"], r"messages\[0\] must be a dict"),
])
def test_chat_template_rejects_bad_messages(tok, messages, match):
    with pytest.raises((TypeError, ValueError), match=match):
        tok.apply_chat_template(messages)


def test_missing_and_corrupt_files(tmp_path, gguf_path):
    with pytest.raises(FileNotFoundError, match="no model or tokenizer"):
        load_tokenizer(tmp_path / "nowhere.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        from_gguf(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:1_000_000])  # truncated inside the vocabulary
    with pytest.raises(ValueError, match="not a readable GGUF"):
        from_gguf(cut)
    js = tmp_path / "tokenizer.json"
    js.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        load_tokenizer(js)
    with pytest.raises(TypeError, match="model source must be a path"):
        load_tokenizer(3.14)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_tokenizer(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor a .gguf"):
        load_tokenizer(empty)


def test_train_rejects_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_bpe("abc", vocab_size=100)
    with pytest.raises(TypeError, match="text must be a str"):
        train_bpe(b"abc", vocab_size=300)


def test_unknown_bytes_drop_or_unk(tok):
    import copy

    assert tok.bytes_to_ids(b"a\x04\x04b") == [tok.byte_to_id[ord("a")], tok.byte_to_id[ord("b")]]
    unk = copy.copy(tok)
    unk.unk_token_id, unk.fuse_unk = 0, False
    assert unk.bytes_to_ids(b"a\x04\x04b") == [tok.byte_to_id[ord("a")], 0, 0, tok.byte_to_id[ord("b")]]
    unk.fuse_unk = True
    assert unk.bytes_to_ids(b"a\x04\x04b") == [tok.byte_to_id[ord("a")], 0, tok.byte_to_id[ord("b")]]


@pytest.mark.parametrize("change,match", [
    ({"decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "Ġ"}, "content": " "},
                                                   {"type": "ByteLevel"}]}}, "would change decoded text"),
    ({"decoder": {"type": "Metaspace"}}, "not byte-level"),
    ({"normalizer": {"type": "Lowercase"}}, "normalizer"),
    ({"pre_tokenizer": {"type": "Whitespace"}}, "pre-tokenizer 'Whitespace'"),
    ({"model": {"type": "Unigram"}}, "model type 'Unigram'"),
])
def test_tokenizer_json_refuses_what_it_cannot_do(tmp_path, change, match):
    import json

    tok = train_bpe(TRAIN_TEXT, vocab_size=300)
    spec = to_tokenizer_json(tok)
    spec.update(change)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=match):
        load_tokenizer(path)


# ---- corners a reviewer's mutations found untested ------------------------------------------------


def test_training_ties_go_to_the_first_seen_pair_and_it_stops_when_nothing_repeats():
    assert next(iter(train_bpe("abab cdcd", vocab_size=257).merges)) == (ord("a"), ord("b"))
    assert next(iter(train_bpe("cdcd abab", vocab_size=257).merges)) == (ord("c"), ord("d"))
    assert train_bpe("abcdefg", vocab_size=300).vocab_size == 256  # no pair occurs twice
    with pytest.raises(TypeError, match="list of strings"):
        train_bpe("abc", vocab_size=300, special_tokens="<|end|>")
    with pytest.raises(ValueError, match="distinct"):
        train_bpe("abc", vocab_size=300, special_tokens=["<|a|>", "<|a|>"])


def test_heap_bpe_equals_the_loop_and_long_runs_are_fast(tok, seed):
    import time

    from minillm.tokenizer.bpe import LONG_CHUNK, bpe_heap

    def loop(ids, merges):
        while len(ids) >= 2:
            ranked = [(merges[p][0], p) for p in zip(ids, ids[1:]) if p in merges]
            if not ranked:
                return ids
            _, p = min(ranked)
            ids = merge_pair(ids, p, merges[p][1])
        return ids

    rng = random.Random(seed)
    for _ in range(100):
        text = "".join(rng.choice("abcdefghij klmnop éü東😀0123+/=") for _ in range(rng.randint(1, 3 * LONG_CHUNK)))
        ids = tok.bytes_to_ids(text.encode())
        assert bpe_heap(ids, tok.merges) == loop(ids, tok.merges), text
    dna = "".join(rng.choice("ACGT") for _ in range(50_000))  # one 50,000-letter chunk
    start = time.perf_counter()
    ids = tok.encode(dna)
    assert time.perf_counter() - start < 5
    assert tok.decode(ids) == dna


def test_overlapping_added_tokens_and_duplicate_merges_match_hf(tmp_path):
    import json

    from tokenizers import Tokenizer as HFTokenizer

    tok = train_bpe(TRAIN_TEXT, vocab_size=300)
    spec = to_tokenizer_json(tok)
    for j, text in enumerate(["ab", "abc", "bcd"]):  # overlapping added tokens: HF takes the longest leftmost
        spec["added_tokens"].append({"id": 300 + j, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
    spec["model"]["merges"].append(spec["model"]["merges"][0])  # a repeated merge: HF keeps its last rank
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    ours, oracle = load_tokenizer(path), HFTokenizer.from_file(str(path))
    for text in ["xabcdy", "abcd", "ab bcd abc", "  the  the", *FIXED]:
        assert ours.encode(text) == oracle.encode(text).ids, text


def test_byte_level_detokenizer_on_invalid_utf8(seed):
    """A byte-only vocabulary makes any byte sequence a token sequence: stray continuations,
    overlong leads (0xC0), out-of-range leads (0xF5-0xFF), truncated characters."""
    byte_tok = train_bpe("x", vocab_size=256)
    rng = random.Random(seed)
    for _ in range(500):
        data = bytes(rng.choice([rng.randrange(256), rng.choice(b"\xc0\xc1\xf5\xf8\xff\x80\xbf\xe2\xf0")])
                     for _ in range(rng.randint(1, 12)))
        detok = IncrementalDetokenizer(byte_tok)
        pieces = [detok.step(b) for b in data] + [detok.flush()]
        assert "".join(pieces) == data.decode("utf-8", errors="replace"), data
    assert complete_prefix(b"ab\xff") in (2, 3) and complete_prefix(b"\x80") == 1


def test_cache_eviction_keeps_results(tok, monkeypatch):
    from minillm.tokenizer import tokenizer as module

    monkeypatch.setattr(module, "_CACHE_LIMIT", 3)
    fresh = copy_tok(tok)
    text = FIXED[1] + " " + FIXED[3]
    assert fresh.encode(text) == tok.encode(text)
    assert len(fresh._cache) <= 3


def copy_tok(tok):
    import copy

    fresh = copy.copy(tok)
    fresh._cache = {}
    return fresh


def test_gguf_control_and_user_defined_tokens(tmp_path):
    """A GGUF marks added tokens as control (special) or user-defined (matched whole, not special)."""
    import gguf

    from minillm.tokenizer.byte_level import byte_to_char

    tokens = [byte_to_char()[b] for b in range(256)] + ["<|ctl|>", "<think>", "Ġa"]
    types = [1] * 256 + [3, 4, 1]
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ a"])
    w.add_eos_token_id(256)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = from_gguf(path)
    ids = tok.encode("x<|ctl|> a<think>")
    assert ids == [ord("x") - 33, 256, 258, 257] or ids[-1] == 257
    assert 256 in ids and 257 in ids and 258 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "x a<think>"  # user-defined survives the skip
    assert tok.eos_token == "<|ctl|>"


@pytest.mark.parametrize("bad,err", [(None, TypeError), (5, TypeError), ([True], TypeError)])
def test_decode_type_errors(tok, bad, err):
    with pytest.raises(err, match="token ids? "):
        tok.decode(bad)


def test_allowed_special_must_be_a_set(tok):
    with pytest.raises(ValueError, match="allowed_special must be"):
        tok.encode("hi", allowed_special=123)


@pytest.mark.parametrize("spec,match", [
    ({"model": {"type": "BPE"}}, "vocab"),
    ([1, 2, 3], "tokenizer.json minillm can read"),
    ({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"content": "<x>"}]}, "id"),
    ({"model": {"type": "BPE", "vocab": {}, "merges": []}}, "non-empty mapping"),
])
def test_malformed_tokenizer_json(tmp_path, spec, match):
    import json

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=match):
        load_tokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    path.write_text(json.dumps(to_tokenizer_json(train_bpe("aa", vocab_size=256))))
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(path)


def test_hub_id_for_a_tokenizer_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not download 'nobody/no-such-model'"):
        load_tokenizer("nobody/no-such-model")
