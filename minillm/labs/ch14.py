"""Checks for lab 14: the DFA-to-token-index step and the mask application, run inside the engine.

Both checks build a small LLMEngine (a tiny random Llama on the CPU) over the first 1,024 tokens of
SmolLM2's real vocabulary (17 special tokens, the 256 bytes, the first merges: ' the', 'ing', ...),
so tokens cross the regex's boundaries as real BPE tokens do. Each case is a fresh random regex.

Exercise 1 (dfa_token_bitmask): the student's mask of every state of the regex's DFA is compared with
the engine's own (CompiledGrammar.mask_for); then the student's rows are plugged into the engine's
token index (CompiledGrammar.set_index_rows), requests run through the engine, and the bitmask the
engine handed the worker at every step is compared with xgrammar's along the same tokens (with
minillm's own matcher when xgrammar is not installed).

Exercise 2 (apply_bitmask): the student's function against minillm's apply_token_bitmask on random
logits and masks; then it replaces minillm's at the worker's one mask point
(sampling/token_mask.py) and a batch mixing constrained and free requests must give the engine's own
tokens, every finished constrained output matching its regex.
"""

from __future__ import annotations

import random
import re
from unittest import mock

import numpy as np
import torch

from ..config import ModelConfig
from ..engine import EngineConfig, LLMEngine
from ..loader import load_model
from ..sampling import SamplingParams, token_mask
from ..structured_output import Matcher, StructuredOutputsParams
from ..structured_output.bitmask import apply_token_bitmask
from ..structured_output.token_index import unpack_bits
from .checker import CheckFailed, check
from .hints import Hints

LAB_VOCAB = 1024


class LabTokenizer:
    """SmolLM2's tokenizer cut to its first LAB_VOCAB ids: what the engine reads of a tokenizer."""

    def __init__(self, tok, n: int = LAB_VOCAB):
        self.vocab = list(tok.vocab[:n])
        self.special_ids = {i for i in tok.special_ids if i < n}
        self.eos_token_id = tok.eos_token_id
        self.chat_template = None

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        return b"".join(self.vocab[i] for i in ids if not (skip_special_tokens and i in self.special_ids))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", "replace")


_CACHE: dict = {}


def lab_tokenizer() -> LabTokenizer:
    if "tok" not in _CACHE:
        from ..tokenizer import load_tokenizer

        _CACHE["tok"] = LabTokenizer(load_tokenizer())
    return _CACHE["tok"]


def _model():
    if "model" not in _CACHE:
        cfg = ModelConfig(architecture="llama", vocab_size=LAB_VOCAB, hidden_size=32, intermediate_size=64,
                          num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
                          name="lab14-random")
        model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(14)
        with torch.no_grad():
            for name, p in model.named_parameters():  # large weights: clear winners among the logits
                norm = "norm" in name
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
        _CACHE["model"] = model
    return _CACHE["model"]


def lab_engine() -> LLMEngine:
    tok = lab_tokenizer()
    return LLMEngine(_model(), tok, [tok.eos_token_id], EngineConfig(block_size=8, num_gpu_blocks=128), progress=False)


# Regexes both backends read alike (no '.', no negated classes: see structured_output/peer.py).
_ATOMS = ["a", "e", "t", "h", "s", " ", "-", "@", "1", "0", "é", r"\.", "the", "at", " is", "ing", "on"]
_CLASSES = ["[a-e]", "[0-9]", r"\d", "[aeiou]", "[a-z]", "[ -/]", "[A-Z]", "[st]"]


def random_regex(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if depth >= 2 or r < 0.4:
        node = rng.choice(_ATOMS + _CLASSES)
    elif r < 0.7:
        node = "".join(random_regex(rng, depth + 1) for _ in range(rng.randint(2, 3)))
    else:
        node = "(" + "|".join(random_regex(rng, depth + 1) for _ in range(rng.randint(2, 3))) + ")"
    q = rng.choice(["", "", "?", "*", "+", "{1,3}", "{2}"])
    if q and not (len(node) == 1 or node in _CLASSES or node == r"\."):  # a quantifier binds one atom
        node = f"({node})"
    return node + q


def _requests(regex: str, rng: random.Random, free: bool):
    so = StructuredOutputsParams(regex=regex)
    reqs = [SamplingParams(max_tokens=16, temperature=0, structured_outputs=so),
            SamplingParams(max_tokens=16, temperature=1.0, seed=rng.randrange(1 << 30), structured_outputs=so)]
    if free:
        reqs.append(SamplingParams(max_tokens=6, temperature=1.0, seed=rng.randrange(1 << 30), ignore_eos=True))
    prompts = [[rng.randrange(LAB_VOCAB) for _ in range(rng.randint(2, 6))] for _ in reqs]
    return prompts, reqs


def _run(engine: LLMEngine, prompts, reqs, record: dict | None = None) -> list[tuple[list[int], str, str]]:
    """-> (token ids, text, finish reason) per request. record: seq_id -> the mask rows the engine made."""
    real = engine.structured.bitmask

    def bitmask(seqs):
        rows = real(seqs)
        if rows is not None and record is not None:
            for s, row in zip(seqs, rows):
                if s.seq_id in engine.structured.matchers:
                    record.setdefault(engine._group_of[s.seq_id].request_id, []).append(row.copy())
        return rows

    engine.structured.bitmask = bitmask
    for i, (p, sp) in enumerate(zip(prompts, reqs)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    del engine.structured.bitmask
    return [(outs[f"r{i}"].token_ids, outs[f"r{i}"].text, outs[f"r{i}"].finish_reason) for i in range(len(reqs))]


def _oracle_masks(regex: str, tokens: list[int]) -> tuple[str, list[np.ndarray]]:
    """The masks along these tokens from xgrammar (else minillm's own matcher, freshly compiled)."""
    from ..structured_output import GrammarCompiler, TokenVocab

    tok = lab_tokenizer()
    vocab = TokenVocab.from_tokenizer(tok, LAB_VOCAB, stop_ids=[tok.eos_token_id])
    out = []
    try:
        import xgrammar as xgr

        from ..structured_output.peer import xgrammar_tokenizer_info
    except ImportError:
        m = Matcher(GrammarCompiler(vocab).compile(StructuredOutputsParams(regex=regex)))
        for t in tokens:
            row = np.zeros(vocab.num_words, dtype=np.int32)
            m.fill_bitmask(row)
            out.append(row)
            m.accept_token(t)
        return "minillm's matcher", out
    if "xgr_info" not in _CACHE:
        _CACHE["xgr_info"] = xgrammar_tokenizer_info(vocab)
    xm = xgr.GrammarMatcher(xgr.GrammarCompiler(_CACHE["xgr_info"], max_threads=1).compile_regex(regex))
    buf = xgr.allocate_token_bitmask(1, LAB_VOCAB)
    for t in tokens:
        xm.fill_next_token_bitmask(buf)
        out.append(buf[0].numpy().copy())
        xm.accept_token(t)
    return "xgrammar", out


def _describe(row: np.ndarray, want: np.ndarray) -> str:
    tok = lab_tokenizer()
    a, b = unpack_bits(np.asarray(row), LAB_VOCAB), unpack_bits(want, LAB_VOCAB)
    extra = [tok.vocab[t] for t in np.nonzero(a & ~b)[0][:6]]
    missing = [tok.vocab[t] for t in np.nonzero(b & ~a)[0][:6]]
    return f"allows {extra} that it should not; leaves out {missing}"


# ---- exercise 1: the DFA-to-token-index step --------------------------------------------------------


def check_dfa_token_bitmask(fn, cases: int = 6):
    """fn(trans [S, 256] int32, final [S] bool, state, token_bytes: list[bytes], stop_ids) -> [ceil(V/32)] int32."""
    tok = lab_tokenizer()

    def run(regex: str, seed: int, student: bool):
        engine = lab_engine()
        so = StructuredOutputsParams(regex=regex)
        compiled = engine.structured.compile(so, "lab")
        dfa = compiled.pda.dfas["$root"]  # a regex is one DFA: its states are the automaton's nodes
        if not student:
            return [compiled.mask_for(frozenset({compiled.pda.stack(-1, s)})).tolist() for s in range(dfa.num_states)]
        rows = []
        for s in range(dfa.num_states):
            row = np.asarray(fn(dfa.trans.copy(), dfa.final.copy(), s, list(compiled.vocab.token_bytes),
                                list(compiled.vocab.stop_ids)))
            want = compiled.mask_for(frozenset({compiled.pda.stack(-1, s)}))
            if row.shape != want.shape or row.dtype != np.int32:
                raise CheckFailed(f"❌ dfa_token_bitmask: expected an int32 array of shape {want.shape}, got "
                                  f"{row.dtype} {row.shape} (regex {regex!r}, state {s})")
            if not np.array_equal(row, want):
                raise CheckFailed(f"❌ dfa_token_bitmask: regex {regex!r}, state {s} of {dfa.num_states} "
                                  f"(final: {bool(dfa.final[s])}): your mask {_describe(row, want)}")
            rows.append(row)
        # Inside the engine: the student's rows are the token index every step of these requests reads.
        compiled.set_index_rows(np.stack(rows).astype(np.int32))
        prompts, reqs = _requests(regex, random.Random(seed), free=False)
        record: dict = {}
        outs = _run(engine, prompts, reqs, record)
        for i, (ids, text, reason) in enumerate(outs):
            oracle, masks = _oracle_masks(regex, ids)
            for step, (got, want) in enumerate(zip(record.get(f"r{i}", []), masks)):
                if not np.array_equal(got, want):
                    raise CheckFailed(f"❌ dfa_token_bitmask: inside the engine, regex {regex!r}, request {i}, step "
                                      f"{step}: the engine's mask (your rows) {_describe(got, want)} ({oracle})")
            if reason == "stop" and not re.fullmatch(regex, text):
                raise CheckFailed(f"❌ dfa_token_bitmask: the engine wrote {text!r}, which {regex!r} does not match")
        return [r.tolist() for r in rows]

    def make(rng: random.Random):
        return random_regex(rng), rng.randrange(1 << 30)

    print(f"vocabulary: the first {len(tok.vocab)} tokens of SmolLM2's; each case a fresh random regex")
    return check("dfa_token_bitmask", lambda r, s: run(r, s, True), lambda r, s: run(r, s, False), make, cases=cases)


# ---- exercise 2: applying the mask to the logits ----------------------------------------------------


def check_apply_bitmask(fn, cases: int = 20):
    """fn(logits [B, V] float, bitmask [B, ceil(V/32)] int32) -> logits with the disallowed tokens at -inf."""

    def make(rng: random.Random):
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        B, V = rng.randint(1, 5), rng.choice([1, 31, 32, 33, 64, 100, 1000])
        W = (V + 31) // 32
        pad = rng.choice([0, 0, 7])  # a padded vocabulary: logits wider than the mask covers, left alone
        logits = torch.randn(B, V + pad, generator=g)
        density = rng.choice([0.0, 0.03, 0.5, 1.0])
        allowed = torch.rand(B, W * 32, generator=g) < density  # [B, 32W]
        words = (allowed.view(B, W, 32).long() << torch.arange(32)).sum(-1)  # [B, W] as unsigned 32-bit
        mask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        return logits, mask

    def student(logits, mask):
        return fn(logits.clone(), mask.clone())

    def reference(logits, mask):
        return apply_token_bitmask(logits.clone(), mask)

    check("apply_bitmask", student, reference, make, cases=cases)

    # Inside the engine: the student's function at the worker's one mask point.
    def run(regex: str, seed: int, student: bool):
        engine = lab_engine()
        prompts, reqs = _requests(regex, random.Random(seed), free=True)
        if not student:
            return _run(engine, prompts, reqs)
        with mock.patch.object(token_mask, "apply_token_bitmask", lambda x, m: fn(x, m)):
            outs = _run(engine, prompts, reqs)
        for _ids, text, reason in outs[:2]:
            if reason == "stop" and not re.fullmatch(regex, text):
                raise CheckFailed(f"❌ apply_bitmask: inside the engine, {regex!r} got {text!r}")
        return outs

    return check("apply_bitmask inside the engine", lambda r, s: run(r, s, True), lambda r, s: run(r, s, False),
                 lambda rng: (random_regex(rng), rng.randrange(1 << 30)), cases=4)


hint = Hints("14", {
    "dfa_token_bitmask": (
        "A token is allowed in `state` when walking its bytes one by one through `trans` never reaches -1. "
        "Empty tokens (special ones) are never allowed; a stop token is allowed exactly when `final[state]`.",
        "Collect the allowed token ids, then pack them: token t is bit (t % 32) of word t // 32. Word 31's bit "
        "makes the int32 negative - build the words as uint32 and view them as int32, or use "
        "np.packbits(bool_array, bitorder='little').view('<i4') after padding to a multiple of 32.",
        "V = len(token_bytes); ok = np.zeros(32 * ((V + 31) // 32), bool)\nfor t, b in enumerate(token_bytes):\n"
        "    s = state\n    for byte in b:\n        s = trans[s, byte]\n        if s < 0: break\n"
        "    ok[t] = bool(b) and s >= 0\nfor t in stop_ids: ok[t] = bool(final[state])\n"
        "return np.packbits(ok, bitorder='little').view('<i4')",
    ),
    "apply_bitmask": (
        "Unpack the mask to one bool per token, then set the logits whose bit is 0 to -inf. Columns past "
        "32 * W (a padded vocabulary) are left as they are.",
        "bit j of word w allows token 32w + j: (bitmask[:, :, None] >> torch.arange(32)) & 1 is [B, W, 32]; "
        "reshape it to [B, 32W] and keep the first min(V, 32W) columns.",
        "V = min(logits.shape[1], 32 * bitmask.shape[1])\nbits = (bitmask.unsqueeze(-1) >> torch.arange(32, "
        "device=bitmask.device)) & 1\nallowed = bits.reshape(bitmask.shape[0], -1)[:, :V].bool()\n"
        "logits[:, :V] = logits[:, :V].masked_fill(~allowed, float('-inf'))\nreturn logits",
    ),
})
