"""Checks for lab 15: a StreamingLLM keep-set and H2O's victim choice, each run inside the engine.

Both checks first compare the student's function with the engine's own policy (engine/kv_eviction.py) on
fresh random inputs, then put it into a live LLMEngine in the policy's place (the block manager asks the
policy object before every step; the check swaps that object's method for the student's) and run
random prompts through a tiny random Llama on the CPU: the greedy tokens AND the map of which table
entries hold a block after every step must be those of the engine running its own policy.

Exercise 1 (streaming_evictable): StreamingLLM's range of table entries no query of the next step reads.
Exercise 2 (h2o_victims): which blocks H2O gives back: the lightest by accumulated attention mass, past
the budget, never the recent window's.
"""

from __future__ import annotations

import random

import torch

from ..config import ModelConfig
from ..engine import EngineConfig, LLMEngine
from ..engine.kv_eviction import H2O, NULL_BLOCK, StreamingLLM
from ..loader import load_model
from ..sampling import SamplingParams
from .checker import CheckFailed, check
from .hints import Hints

VOCAB, BS = 128, 4

hint = Hints("15", {
    "streaming_evictable": (
        "The sinks are whole blocks at the start of the table; the recent window is whole blocks ending with the "
        "block that holds position `start`. Everything strictly between them goes.",
        "sink blocks = ceil(sink_tokens / block_size) (a partial sink block is still a block); recent blocks = "
        "kv_budget // block_size - sink blocks, and they include start's own block, start // block_size.",
        "lo = -(-sink_tokens // block_size); recent = kv_budget // block_size - lo; "
        "hi = start // block_size - recent + 1; return lo, hi (hi <= lo means nothing to evict).",
    ),
    "h2o_victims": (
        "Count only the blocks still held (an evicted entry points at block 0, NULL_BLOCK) and only those "
        "before the step's own block, start // block_size: that one is being written and always stays.",
        "excess = held + 1 - budget_blocks (the +1 is the step's own block). The last recent_blocks - 1 held "
        "entries are the recent window (recent_blocks = max(1, budget_blocks // 2)): never victims. Among the "
        "rest, the lightest by mass (a missing entry weighs 0) go; ties: the older entry first.",
        "cur = start // bs; held = [i for i in range(min(cur, len(table))) if table[i] != 0]; excess = len(held) "
        "+ 1 - budget; if excess <= 0: return []; cand = held[:len(held) - (max(1, budget // 2) - 1)]; "
        "return sorted(sorted(cand, key=lambda i: mass.get(i, 0.0))[:excess])",
    ),
})


class _Tokenizer:
    """A random model has no text: every id decodes to nothing (the engine detokenizes every token)."""

    eos_token_id = None

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        return b""


_CACHE: dict = {}


def _model():
    """A 2-layer random Llama on the CPU, fp32, every layer full attention (what StreamingLLM and H2O need)."""
    if "model" not in _CACHE:
        cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512, name="lab15-random")
        model, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(15)
        with torch.no_grad():
            for name, p in model.named_parameters():  # large weights: clear winners among the logits
                norm = "norm" in name
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
        _CACHE["model"] = model
    return _CACHE["model"]


def lab_engine(**policy) -> LLMEngine:
    cfg = EngineConfig(block_size=BS, num_gpu_blocks=128, max_num_batched_tokens=8, **policy)
    return LLMEngine(_model(), _Tokenizer(), [], cfg, progress=False)


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """-> (greedy tokens per prompt, after every step the kept map of every table: 1 = holds a block)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    got, trace = {}, []
    while engine.has_unfinished_requests():
        got |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished}
        trace.append(sorted((s, [int(b != NULL_BLOCK) for b in t]) for s, t in engine.block_manager.block_tables.items()))
    return [got[f"r{i}"] for i in range(len(prompts))], trace


def _prompts(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(rng.randint(1, 3))]


def _in_engine(name: str, policy: dict, patch, rng_seed: int):
    """The engine with its own policy, then with `patch(policy_object)` applied: tokens and kept maps equal."""
    rng = random.Random(rng_seed)
    prompts, max_tokens = _prompts(rng), rng.randint(12, 40)
    want = run_engine(lab_engine(**policy), prompts, max_tokens)
    engine = lab_engine(**policy)
    patch(engine.block_manager.eviction)
    got = run_engine(engine, prompts, max_tokens)
    if got[1] != want[1]:
        step = next(i for i, (a, b) in enumerate(zip(got[1], want[1])) if a != b)
        raise CheckFailed(f"❌ {name}: inside the engine ({policy}), prompts of {[len(p) for p in prompts]} tokens: "
                          f"after step {step} the tables keep {got[1][step]}, the engine's own policy keeps "
                          f"{want[1][step]} (seq_id, 1 = block held)")
    if got[0] != want[0]:
        raise CheckFailed(f"❌ {name}: inside the engine ({policy}): tokens {got[0]} instead of {want[0]}")
    return True


# ---- exercise 1: StreamingLLM's keep-set --------------------------------------------------------------

def check_streaming_evictable(fn, cases: int = 200, engine_cases: int = 3):
    """fn(start, block_size, sink_tokens, kv_budget) -> (lo, hi): table entries lo..hi-1 are evicted."""
    def make(rng: random.Random):
        bs = rng.choice([1, 2, 4, 8, 16])
        sink = rng.choice([0, 1, 3, 4, 8, bs, 2 * bs + 1])
        sink_blocks = -(-sink // bs)
        budget = (sink_blocks + rng.randint(1, 6)) * bs + rng.randrange(bs)  # not always a whole number of blocks
        return rng.randrange(0, 40 * bs), bs, sink, budget

    def evicted(lo_hi, start, bs):  # what the block manager does with (lo, hi): entries of the table so far
        lo, hi = (int(x) for x in lo_hi)
        return list(range(lo, min(hi, start // bs + 1)))

    def reference(start, bs, sink, budget):
        return evicted(StreamingLLM(sink, budget, bs, max_chunk=8).evictable(start), start, bs)

    def student(start, bs, sink, budget):
        return evicted(fn(start, bs, sink, budget), start, bs)

    check("streaming_evictable", student, reference, make, cases=cases)

    def patch(pol):
        budget = (pol.sink_blocks + pol.recent_blocks) * pol.block_size
        pol.evictable = lambda start: tuple(fn(start, pol.block_size, pol.sink_blocks * pol.block_size, budget))

    def engine_case(rng: random.Random):
        return ({"kv_eviction": "streaming", "sink_tokens": rng.choice([0, 2, 4]), "kv_budget": rng.choice([12, 16])},
                rng.randrange(1 << 30))

    return check("streaming_evictable inside the engine", lambda p, s: _in_engine("streaming_evictable", p, patch, s),
                 lambda p, s: True, engine_case, cases=engine_cases)


# ---- exercise 2: H2O's victims --------------------------------------------------------------------------

def check_h2o_victims(fn, cases: int = 200, engine_cases: int = 3):
    """fn(table, start, block_size, budget_blocks, mass: {entry: float}) -> sorted list of entries to evict."""
    def make(rng: random.Random):
        bs = rng.choice([1, 2, 4, 16])
        n = rng.randint(1, 24)
        table = [NULL_BLOCK if rng.random() < 0.2 else rng.randint(1, 999) for _ in range(n)]
        start = rng.randint((n - 1) * bs, n * bs)  # in the last entry, or just past it (a new block)
        mass = {i: round(rng.random() * 3, 1) for i in range(n) if rng.random() < 0.9}  # ties; some entries unseen
        return table, start, bs, rng.randint(2, 10), mass

    def reference(table, start, bs, budget, mass):
        pol = H2O(budget * bs, bs, max_chunk=8)
        pol.mass[0] = dict(mass)
        return pol.victims(0, list(table), start, None)

    def student(table, start, bs, budget, mass):
        return sorted(int(i) for i in fn(list(table), start, bs, budget, dict(mass)))

    check("h2o_victims", student, reference, make, cases=cases)

    def patch(pol):
        pol.victims = lambda seq_id, table, start, done: sorted(
            fn(list(table), start, pol.block_size, pol.budget_blocks, dict(pol.mass.get(seq_id, {}))))

    def engine_case(rng: random.Random):
        return {"kv_eviction": "h2o", "kv_budget": rng.choice([12, 16, 20])}, rng.randrange(1 << 30)

    return check("h2o_victims inside the engine", lambda p, s: _in_engine("h2o_victims", p, patch, s),
                 lambda p, s: True, engine_case, cases=engine_cases)
