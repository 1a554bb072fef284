"""Shared fixtures: a fresh random seed per run (printed, so a failure can be replayed), the
embedded model's tokenizer, and the Hugging Face oracle for it."""

from __future__ import annotations

import os
import random

import pytest
import torch

# Triton kernels run on a CPU under Triton's interpreter; it is chosen when a kernel is decorated,
# so the switch must be set before any minillm.kernels module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # up to 8 test workers share one GPU: each engine's KV pool takes a small share of it
    os.environ.setdefault("MINILLM_GPU_MEMORY_UTILIZATION", "0.08")

from minillm.model_files import embedded_model_path


def pytest_report_header(config):
    return f"minillm test seed: {_SEED} (replay with MINILLM_TEST_SEED={_SEED})"


_SEED = int(os.environ.get("MINILLM_TEST_SEED", random.SystemRandom().randrange(2**31)))


@pytest.fixture
def seed() -> int:
    return _SEED


@pytest.fixture(scope="session")
def gguf_path():
    return embedded_model_path()


@pytest.fixture(scope="session")
def tok():
    from minillm import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def hf_tok(gguf_path):
    """The oracle: HF `tokenizers`, as transformers builds it from the same GGUF file."""
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_unk_mode(tok, hf_tok) -> str:
    """What this transformers version does with a byte the GGUF vocabulary has no token for.

    transformers 5.23 drops it, as llama.cpp and minillm do ("drop"); 5.17 (the GPU machine's) maps
    it to the unk token <|endoftext|> ("unk"). Parity is then tested on text without such bytes,
    and the unk behaviour separately (test_tokenizer_parity.py).
    """
    probe = "a\x04b"
    return "drop" if hf_tok.encode(probe) == tok.encode(probe) else "unk"


@pytest.fixture(scope="session")
def comparable(tok, hf_unk_mode):
    """texts -> the texts to hold to the HF oracle: all of them, or without the bytes HF maps to unk."""

    def keep(texts):
        if hf_unk_mode == "drop":
            return list(texts)
        return ["".join(c for c in t if tok.covers(c)) for t in texts]

    return keep


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random llama checkpoint with a chat template (the server tests' model)."""
    from serve_utils import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
