"""A GGUF header that lies is refused when it is read, with one line naming the file, the key and the
value (probe round 4, m5): 0 heads (a raw ZeroDivisionError before), a NaN or negative rope base or
norm epsilon (loaded, then every logit was NaN), a block count that disagrees with the tensors (a
"has no place" naming neither), a context of one token (an engine that refused every request), and
a control token spelled twice (chat answered '')."""

from __future__ import annotations

import numpy as np
import pytest

from minillm.loader.gguf_loader import read_config
from minillm.tokenizer import from_gguf
from minillm.tokenizer.byte_level import spell

HIDDEN = 8
PLAIN = [spell(bytes([b])) for b in range(256)] + [spell(b"ab")]  # the bytes and the one merge's token


def write_gguf(path, **changes):
    """A tiny llama GGUF: 2 blocks, a vocabulary of the 256 bytes, "ab" and two control tokens.
    changes: metadata key (without 'llama.') -> value, or tokens=[...] for the token list."""
    import gguf

    tokens = changes.pop("tokens", None) or [*PLAIN, "<|im_start|>", "<|im_end|>"]
    types = [1] * len(PLAIN) + [3] * (len(tokens) - len(PLAIN))  # 3: control
    ints = {"block_count": 2, "embedding_length": HIDDEN, "feed_forward_length": 16, "attention.head_count": 2,
            "attention.head_count_kv": 1, "context_length": 64}
    floats = {"attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**ints, **floats, **changes}.items():
        if isinstance(value, float):
            w.add_float32(f"llama.{key}", value)
        else:
            w.add_int32(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{spell(b'a')} {spell(b'b')}"])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.normal(size=(len(tokens), HIDDEN)).astype(np.float32))
    for b in range(2):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_truthful_header_loads(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf")
    config = read_config(path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 2, 1, 4)
    tok = from_gguf(path)
    assert tok.encode("ab<|im_end|>") == [256, 258]


@pytest.mark.parametrize("key, value, match", [
    ("attention.head_count", 0, r"llama.attention.head_count=0 must be a positive int"),
    ("attention.head_count_kv", -1, r"llama.attention.head_count_kv=-1 must be a positive int"),
    ("embedding_length", 0, r"llama.embedding_length=0 must be a positive int"),
    ("rope.freq_base", float("nan"), r"llama.rope.freq_base=nan must be a positive finite number"),
    ("rope.freq_base", -1.0, r"llama.rope.freq_base=-1.0 must be a positive finite number"),
    ("attention.layer_norm_rms_epsilon", float("nan"), r"layer_norm_rms_epsilon=nan must be a positive finite"),
    ("attention.layer_norm_rms_epsilon", float("inf"), r"layer_norm_rms_epsilon=inf must be a positive finite"),
    ("context_length", 1, r"llama.context_length=1: a context must hold a prompt token and a new one"),
    ("block_count", 1, r"llama.block_count=1, but the file holds blocks 0 to 1"),
    ("block_count", 3, r"llama.block_count=3, but the file holds blocks 0 to 1"),
])
def test_a_lying_header_is_refused_naming_file_key_and_value(tmp_path, key, value, match):
    path = write_gguf(tmp_path / "bad.gguf", **{key: value})
    with pytest.raises(ValueError, match=match) as e:
        read_config(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_a_control_token_spelled_twice_is_refused(tmp_path):
    tokens = [*PLAIN, "<|im_start|>", "<|im_end|>", "<|im_end|>"]
    path = write_gguf(tmp_path / "dup.gguf", tokens=tokens)
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' twice \(ids 258 and 259\)") as e:
        from_gguf(path)
    assert str(e.value).startswith(str(path))
