"""Building a Tokenizer from the files models ship: a GGUF header, or Hugging Face's tokenizer.json.

Both store the same three things for a byte-level BPE: the vocabulary (token text in the byte-level
spelling, e.g. 'Ġworld'), the merges in training order ("Ġ w", "o r", ...), and the added tokens
("<|im_start|>"). What differs is where the pre-tokenizer pattern comes from: a GGUF names it
(`tokenizer.ggml.pre`), a tokenizer.json spells out the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..gguf_meta import read_gguf_metadata
from ..model_files import resolve_source
from .bpe import Merges
from .byte_level import unspell
from .pretokenize import DIGITS_EACH, DIGITS_RUN, GGUF_PRESETS, GPT2, PreTokenizer
from .tokenizer import Tokenizer

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp's token types


def load_tokenizer(source=None) -> Tokenizer:
    """The tokenizer of a model.

    source: None for the embedded SmolLM2; a .gguf file; a tokenizer.json; or a Hugging Face model
    folder holding tokenizer.json (with tokenizer_config.json) or a .gguf file.
    """
    path = resolve_source(source)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return from_tokenizer_json(path / "tokenizer.json")
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return from_gguf(ggufs[0])
        raise FileNotFoundError(f"{path} holds neither tokenizer.json nor a .gguf file")
    if path.suffix == ".gguf":
        return from_gguf(path)
    if path.suffix == ".json":
        return from_tokenizer_json(path)
    raise ValueError(f"cannot read a tokenizer from {path}: expected a .gguf file, a tokenizer.json or a model folder")


# ---- GGUF -----------------------------------------------------------------------------------------


def from_gguf(path: str | Path) -> Tokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer.ggml.model is {kind!r}; minillm reads byte-level BPE ('gpt2') tokenizers"
        )
    try:
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merge_lines: list[str] = meta["tokenizer.ggml.merges"]
    except KeyError as e:
        raise ValueError(f"{path}: GGUF metadata lacks {e.args[0]}, needed for the tokenizer") from None
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRESETS:
        raise ValueError(f"{path}: pre-tokenizer {pre!r} is not supported; known: {sorted(GGUF_PRESETS)}")

    ids = {t: i for i, t in enumerate(tokens)}
    # control tokens are special; user-defined ones are matched whole in text but are not special
    added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (GGUF_CONTROL, GGUF_USER_DEFINED)}
    _check_unique_added(tokens, added, path)
    special = [i for i, ty in enumerate(types) if ty == GGUF_CONTROL]
    added_ids = set(added.values())
    return Tokenizer(
        # added tokens are plain text (llama.cpp prints them as is); the rest are byte-level spellings
        vocab=[t.encode("utf-8") if i in added_ids else unspell(t) for i, t in enumerate(tokens)],
        merges=_merges_from_pairs((line.split(" ", 1) for line in merge_lines), ids, str(path)),
        pre_tokenizer=PreTokenizer(GGUF_PRESETS[pre]),
        added_tokens=added,
        special_ids=special,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        name=str(meta.get("general.name", Path(path).stem)),
    )


def _check_unique_added(tokens: list[str], added: dict[str, int], path) -> None:
    """An added token's text must name one id: a second "<|im_end|>" made the chat template's marker
    an id that is not the eos token, so chat answered '' (probe round 4, m5)."""
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in added:
            if t in first:
                raise ValueError(f"{path}: tokenizer.ggml.tokens holds the added token {t!r} twice (ids {first[t]} "
                                 f"and {i}); each control or user-defined token must name one id")
            first[t] = i


# ---- Hugging Face tokenizer.json ----------------------------------------------------------------


def from_tokenizer_json(path: str | Path) -> Tokenizer:
    path = Path(path)
    try:
        return _from_tokenizer_json(path)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a file of the wrong shape
        raise ValueError(f"{path} is not a tokenizer.json minillm can read ({type(e).__name__}: {e})") from e


def _from_tokenizer_json(path: Path) -> Tokenizer:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable tokenizer.json ({e})") from e
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: model type {model.get('type')!r} is not supported; minillm reads BPE")
    vocab_map: dict[str, int] = model["vocab"]
    if not isinstance(vocab_map, dict) or not vocab_map:
        raise ValueError(f"{path}: model.vocab must be a non-empty mapping of token -> id")
    _check_decoder(spec.get("decoder"), model, vocab_map, path)
    added_list = spec.get("added_tokens") or []
    for tok in added_list:
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            raise ValueError(f"{path}: added token {tok['content']!r} uses lstrip/rstrip/single_word, not supported")
        if tok.get("normalized") and spec.get("normalizer"):
            raise ValueError(f"{path}: added token {tok['content']!r} is matched after normalization, not supported")
    size = max([*vocab_map.values(), *(t["id"] for t in added_list)]) + 1
    vocab: list[bytes | None] = [None] * size
    for text, i in vocab_map.items():
        vocab[i] = unspell(text)
    for tok in added_list:
        vocab[tok["id"]] = tok["content"].encode("utf-8")
    holes = [i for i, v in enumerate(vocab) if v is None]
    if holes:
        raise ValueError(f"{path}: token ids {holes[:5]} have no entry in vocab or added_tokens")

    pairs = (m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges", []))
    config = _read_config(path.parent)
    added = {t["content"]: t["id"] for t in added_list}
    bos, eos, add_bos, add_eos = _bos_eos(spec.get("post_processor"), added, config)
    unk = model.get("unk_token")
    unk_id = vocab_map.get(unk, added.get(unk)) if unk is not None else None
    return Tokenizer(
        vocab=vocab,
        merges=_merges_from_pairs(pairs, vocab_map, str(path)),
        pre_tokenizer=_pre_tokenizer(spec, path),
        added_tokens=added,
        special_ids=[t["id"] for t in added_list if t.get("special")],
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=config.get("chat_template"),
        unk_token_id=unk_id,
        fuse_unk=bool(model.get("fuse_unk")),
        name=path.parent.name,
    )


_BYTE_TOKEN = "<0x"  # SentencePiece-style byte tokens, used by byte_fallback


def _check_decoder(decoder: dict | None, model: dict, vocab: dict[str, int], path: Path) -> None:
    """Accept a ByteLevel decoder, alone or in a Sequence whose other steps change no token of this
    vocabulary (some transformers versions write ByteFallback/Fuse/Replace('▁') around it)."""
    if model.get("byte_fallback") and any(t.startswith(_BYTE_TOKEN) for t in vocab):
        raise ValueError(f"{path}: byte_fallback with <0x..> byte tokens is SentencePiece-style, not supported")
    if decoder is None or decoder.get("type") == "ByteLevel":
        return
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = [d.get("type") for d in steps]
    if "ByteLevel" not in kinds:
        raise ValueError(f"{path}: decoder {kinds} is not byte-level; minillm reads byte-level BPE")
    for step in steps:
        kind = step.get("type")
        if kind in ("ByteLevel", "Fuse"):  # Fuse only joins strings
            continue
        if kind == "ByteFallback" and not any(t.startswith(_BYTE_TOKEN) for t in vocab):
            continue  # nothing to fall back to
        pattern = step.get("pattern", {}).get("String")
        if kind == "Replace" and pattern and not any(pattern in t for t in vocab):
            continue  # its pattern occurs in no token
        raise ValueError(f"{path}: decoder step {kind!r} would change decoded text; not supported")


def _pre_tokenizer(spec: dict, path: Path) -> PreTokenizer:
    """Translate HF's normalizer + pre_tokenizer pipeline into split patterns."""
    norm = spec.get("normalizer")
    norms = (norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]) if norm else []
    kinds = [n.get("type") for n in norms]
    if len(kinds) > 1 or any(k not in ("NFC", "NFKC", "NFD", "NFKD") for k in kinds):
        raise ValueError(f"{path}: normalizer {kinds} is not supported (one of NFC, NFKC, NFD, NFKD, or none)")
    normalization = kinds[0] if kinds else None
    pre = spec.get("pre_tokenizer")
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    patterns: list[str] = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise ValueError(f"{path}: ByteLevel add_prefix_space=true is not supported")
            if step.get("use_regex", True):
                patterns.append(GPT2)
        elif kind == "Digits":
            patterns.append(DIGITS_EACH if step.get("individual_digits") else DIGITS_RUN)
        elif kind == "Split":
            pattern = step.get("pattern", {})
            if "Regex" not in pattern or step.get("behavior") != "Isolated" or step.get("invert"):
                raise ValueError(f"{path}: only Split(Regex, behavior=Isolated) is supported, got {step}")
            patterns.append(pattern["Regex"])
        else:
            raise ValueError(f"{path}: pre-tokenizer {kind!r} is not supported (ByteLevel, Digits, Split are)")
    return PreTokenizer(patterns, normalization)


def _bos_eos(post: dict | None, added: dict[str, int], config: dict):
    """BOS/EOS ids, and whether encode adds them: from the post-processor template and the config.

    Llama 3 wraps its TemplateProcessing in a Sequence (after a ByteLevel step that only fixes
    offsets), so look inside one.
    """

    def token_id(value):
        if isinstance(value, dict):  # tokenizer_config stores AddedToken dicts in older files
            value = value.get("content")
        return added.get(value) if isinstance(value, str) else None

    bos, eos = token_id(config.get("bos_token")), token_id(config.get("eos_token"))
    add_bos = add_eos = False
    steps = post.get("processors", []) if post and post.get("type") == "Sequence" else [post] if post else []
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            single = step.get("single", [])
            first_seq = next((i for i, piece in enumerate(single) if "Sequence" in piece), len(single))
            for i, piece in enumerate(single):
                if "SpecialToken" in piece:
                    tid = added.get(piece["SpecialToken"]["id"])
                    if i < first_seq:
                        add_bos, bos = True, tid
                    else:
                        add_eos, eos = True, tid
        elif step.get("type") not in ("ByteLevel",):
            raise ValueError(f"post-processor {step.get('type')!r} is not supported (TemplateProcessing is)")
    return bos, eos, add_bos, add_eos


def _read_config(folder: Path) -> dict:
    config: dict = {}
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        try:
            config = json.loads(cfg.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{cfg} is not valid JSON ({e})") from e
    jinja = folder / "chat_template.jinja"  # newer transformers save the template on its own
    if jinja.is_file() and not config.get("chat_template"):
        config["chat_template"] = jinja.read_text(encoding="utf-8")
    if isinstance(config.get("chat_template"), list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in config["chat_template"]}
        config["chat_template"] = named.get("default")
    return config


def _merges_from_pairs(pairs, ids: dict[str, int], where: str) -> Merges:
    merges: Merges = {}
    for rank, pair in enumerate(pairs):
        if len(pair) != 2:
            raise ValueError(f"{where}: merge {rank} is {pair!r}, not a pair of tokens")
        left, right = pair
        try:
            key, merged = (ids[left], ids[right]), ids[left + right]
        except KeyError as e:
            raise ValueError(f"{where}: merge {rank} ({left!r} {right!r}) names {e.args[0]!r}, not in the vocab") from None
        merges[key] = (rank, merged)  # a repeated merge takes its last rank, as in HF's BPE
    return merges
