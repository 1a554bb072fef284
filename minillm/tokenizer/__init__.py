"""Chapter 01: the byte-level BPE tokenizer, written from scratch.

    tok = load_tokenizer()                       # the embedded SmolLM2's tokenizer
    ids = tok.encode("Hello world")              # [19556, 905]
    tok.decode(ids)                              # 'Hello world'
    tok.apply_chat_template([{"role": "user", "content": "Hi"}])
"""

from .bpe import bpe, merge_pair
from .budget import EncodeStopped, TooManyTokens
from .byte_level import byte_to_char, char_to_byte
from .chat_template import render_chat
from .detokenizer import IncrementalDetokenizer, complete_prefix
from .export import save_tokenizer_json, to_tokenizer_json
from .loaders import from_gguf, from_tokenizer_json, load_tokenizer
from .pretokenize import GPT2, LLAMA3, QWEN2, PreTokenizer
from .tokenizer import Tokenizer
from .train import count_pairs, train_bpe

__all__ = [
    "GPT2",
    "LLAMA3",
    "QWEN2",
    "EncodeStopped",
    "IncrementalDetokenizer",
    "PreTokenizer",
    "Tokenizer",
    "TooManyTokens",
    "bpe",
    "byte_to_char",
    "char_to_byte",
    "complete_prefix",
    "count_pairs",
    "from_gguf",
    "from_tokenizer_json",
    "load_tokenizer",
    "merge_pair",
    "render_chat",
    "save_tokenizer_json",
    "to_tokenizer_json",
    "train_bpe",
]
