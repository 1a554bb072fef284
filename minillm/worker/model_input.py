"""ModelInput: one engine step as plain data, the message from the engine to its executor (chapter 13).

The engine decides *what* runs (the scheduler's sequences and how many new tokens each brings); the
worker that owns the model only needs the step's tokens and where their keys and values live. So the
engine packs each step into lists of numbers, with no padding (chapter 02's layout) and the paged
cache's addresses (chapter 05), for the sequences scheduled with n new tokens each:

    input_ids, positions  [T]        the new tokens and their positions (T = sum of the n's)
    slot_mapping          [T]        cache row of each new token: table[p // bs] * bs + p % bs
    seq_lens              [B]        keys per sequence after this step (cached + new)
    block_table           [B, W]     each sequence's blocks, padded with 0 to the widest
    query_lens            [B]        the n's
    logits_indices        [R]        the token rows whose logits the step computes
    sampling                         how the worker samples those rows (SamplingInput); the step
                                     returns a ModelRunnerOutput: tokens, not logits
    prev_token_dst/src               (chapter 13) rows whose token the GPU sampled last step, and
                                     which row of that step's sampled tokens each takes
    seq_ids, table_updates,          (chapter 13) instead of block_table: the sequences in order, and
    dropped_tables                   what changed in the block tables since the last step; the worker
                                     keeps the tables (worker/block_table.py) and gathers [B, W] itself
    lora_slots, lora_loads           (chapter 16) each sequence's adapter slot [B], and the adapters to
                                     copy into the GPU slots first

The engine builds it (engine/step_input.py, from its Sequence objects); nothing here knows a
Sequence. Plain data is what lets the worker live elsewhere: in this process (UniprocExecutor), or once per GPU
in processes of its own (chapter 11), each receiving the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingInput:
    """Which rows of the step's logits the worker samples, and how (sample_step.py): S sequences, each
    with 1 + k rows (k draft tokens to verify, chapter 09), in the order of the answer."""

    rows: list[int]  # [S] the sequence's first row of logits_indices (a prompt's n > 1 forks share it)
    num_draft: list[int]  # [S] k: draft tokens verified after that row (0: one plain token)
    draft_token_ids: list[int]  # [sum k] the drafts, sequence by sequence
    params: list[Any]  # [S] SamplingParams
    seeds: list[int]  # [S]
    steps: list[int]  # [S] the output position of the sequence's next token: its RNG counter
    banned: list[list[int]]  # [S] tokens that may not be sampled now (masked: token_mask.py)
    prompt_ids: list[list[int]] | None = None  # [S] only when some sequence has a penalty
    output_ids: list[list[int]] | None = None  # [S] likewise
    draft_probs: Any = None  # per drafting sequence [k, V]: q of a model proposer (None: one-hot)
    on_device: bool = False  # overlap scheduling (chapter 13): tokens stay on the device
    bitmask: Any = None  # [S, ceil(V / 32)] int32 numpy: each sequence's allowed tokens (chapter 14)
    # overlap with a grammar (chapter 14): the forward pass runs now; the bitmask comes with the
    # executor's sample_tokens call, once the host has the previous step's tokens
    defer_bitmask: bool = False


@dataclass
class ModelRunnerOutput:
    """What a step returns to the engine (vLLM V1's name): tokens and plain numbers, not logits."""

    sampled_token_ids: list[list[int]]  # [S] each sequence's new tokens (1, or up to k + 1 after a verify)
    logprobs: list | None = None  # [S] None or (logprob, rank, top ids, top logprobs) of its token
    errors: dict[int, Exception] = field(default_factory=dict)  # sequence -> why it got no token
    pending: Any = None  # SampledTokens on their way to the host (on_device steps)
    logits: Any = None  # [rows, V] when the step asked for no sampling (tests, labs, chapter 09's bench)
    kv_stats: Any = None  # chapter 17: KVTransferStats of the step's KV loads and saves (None: no connector)
    kv_block_mass: dict | None = None  # H2O (chapter 15): {seq_id: (table entries, attention mass)} of the step


@dataclass
class ModelInput:
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    seq_lens: list[int]  # [B]
    block_table: list[list[int]]  # [B, W]
    query_lens: list[int]  # [B]
    logits_indices: list[int]  # [R]
    # overlap scheduling (chapter 13): input_ids[prev_token_dst[i]] is -1 here and takes the previous
    # step's sampled token prev_token_src[i], on the GPU, before the forward pass
    prev_token_dst: list[int] = field(default_factory=list)
    prev_token_src: list[int] = field(default_factory=list)
    # the persistent block table (chapter 13): with seq_ids set, block_table is empty and the worker
    # builds it from its own copy after applying dropped_tables, then table_updates (seq_id, start, entries)
    seq_ids: list[int] = field(default_factory=list)
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    dropped_tables: list[int] = field(default_factory=list)
    # the worker samples (sample_step.py); None: the step returns its logits instead
    sampling: SamplingInput | None = None
    # chapter 17: the KV connector's loads and saves this step (KVConnectorMetadata), or None
    kv_connector_metadata: Any = None
    # multi-LoRA (chapter 16): each sequence's adapter slot [B] (-1: none; None: nobody has one), and
    # the adapters (slot, LoRAModel) the worker copies into its GPU slots before the forward pass
    lora_slots: list[int] | None = None
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def pack(chunks: list[tuple[int, list[int], list[int]]], block_size: int,
         logits_indices: list[int] | None = None, pad_tables: bool = True) -> ModelInput:
    """(start position, new token ids, block table) per sequence -> the step's ModelInput; logits at
    logits_indices (default: each sequence's last new token). pad_tables=False leaves block_table
    empty (the worker keeps the tables: engine/step_input.py's table_changes)."""
    ids, pos, slots, seq_lens, tables, lens = [], [], [], [], [], []
    for start, tokens, table in chunks:
        n = len(tokens)
        ids += tokens
        pos += range(start, start + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        seq_lens.append(start + n)
        tables.append(table)
        lens.append(n)
    if logits_indices is None:
        logits_indices, end = [], 0
        for n in lens:
            end += n
            logits_indices.append(end - 1)
    width = max(len(t) for t in tables) if pad_tables else 0
    padded = [t + [0] * (width - len(t)) for t in tables] if pad_tables else []
    return ModelInput(ids, pos, slots, seq_lens, padded, lens, list(logits_indices))
