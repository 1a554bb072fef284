"""KVConnectorBase: the seam between an engine and a remote KV cache (chapter 17; vLLM V1's
KVConnectorBase_V1, its method names).

One connector class, two instances: one beside the scheduler, one beside the worker that owns the
cache; what passes between them each step is plain data (KVConnectorMetadata), like the step itself.

Scheduler side (all on the host, no tensors):

    get_num_new_matched_tokens(seq, num_computed)  prompt tokens after the num_computed ones the local
                                        prefix cache found that the remote side holds; None: not there
                                        yet (the sequence waits in WAITING_FOR_REMOTE_KVS and is asked
                                        again next step); a KVTransferError: it will never come
    update_state_after_alloc(seq, blocks, n)  the scheduler gave the sequence blocks for those n tokens:
                                        this step's worker loads them
    build_connector_meta(scheduled, tables)  -> the step's KVConnectorMetadata (loads and saves)
    request_finished(seq, blocks)       -> (delay_free, kv_transfer_params): keep the blocks until they are
                                        sent (a pull transport reads them after the request ended)
    get_finished()                      -> seq ids whose delayed blocks may be freed now (sent, or timed out)

Worker side (inside the forward pass, through the forward context, so that layer i's transfer
overlaps layer i+1's compute):

    register_kv_caches(model, cache)    the pool it reads and writes (a pull transport may share it)
    bind_connector_metadata(meta)       this step's work; clear_connector_metadata() after
    start_load_kv()                     before the forward pass: start reading every layer
    wait_for_layer_load(layer)          attention layer `layer` waits for its K/V before it attends
    save_kv_layer(layer, k, v, meta)    attention layer `layer` hands off its K/V after writing them
    wait_for_save()                     after the forward pass: every save of the step is done
    take_stats()                        bytes moved and seconds spent since the last call
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ...cache.spec import cache_layers
from .config import KVTransferConfig, transfer_key

logger = logging.getLogger("minillm.kv_transfer")


def log_transfer(verb: str, count: int, nbytes: int, seconds: float) -> None:
    """One line per step that moved K/V: what the chapter's bandwidth is measured from."""
    rate = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    logger.info("KV %s: %d transfer(s), %d bytes in %.2f ms (%.3f GB/s)", verb, count, nbytes, seconds * 1e3, rate)


class KVTransferError(RuntimeError):
    """The remote K/V of a request cannot be had (missing, timed out, a different model's)."""


@dataclass
class ReqLoad:
    """Worker: fill positions [start, end) of this prompt from the remote side into `slots`."""
    key: str
    start: int
    end: int
    slots: list[int]  # [end - start] flat cache rows (block * block_size + offset)
    source: dict = field(default_factory=dict)  # where it is (a pull transport: the producer's blocks)


@dataclass
class ReqSave:
    """Worker: save positions [start, end) of a prompt of num_tokens tokens from `slots`; last: the
    prompt is complete after this step (the transfer may be published)."""
    key: str
    start: int
    end: int
    slots: list[int]
    num_tokens: int
    last: bool


@dataclass
class KVConnectorMetadata:
    loads: list[ReqLoad] = field(default_factory=list)
    saves: list[ReqSave] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class KVTransferStats:
    """What a worker moved: the chapter's bandwidth is bytes / seconds of each direction."""
    bytes_saved: int = 0
    bytes_loaded: int = 0
    seconds_saving: float = 0.0  # wall time from a step's first save to its wait_for_save returning
    # from start_load_kv to the last layer's load landing: wall time, or on a GPU with the shared pool the
    # side stream's copies alone (device events), however long the layers' compute took beside them
    seconds_loading: float = 0.0
    transfers_saved: int = 0
    transfers_loaded: int = 0

    def add(self, other: KVTransferStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        d = {f"kv_{name}": getattr(self, name) for name in self.__dataclass_fields__}
        d["kv_save_gb_per_s"] = self.bytes_saved / self.seconds_saving / 1e9 if self.seconds_saving else 0.0
        d["kv_load_gb_per_s"] = self.bytes_loaded / self.seconds_loading / 1e9 if self.seconds_loading else 0.0
        return d


def remote_params(seq) -> dict | None:
    """The sequence's kv_transfer_params (SamplingParams.extra_args), or None."""
    extra = seq.params.extra_args
    return extra.get("kv_transfer_params") if extra else None


def slots_of(table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class KVConnectorBase(ABC):
    """The shared bookkeeping of both sides; a transport fills in where the bytes go."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config, self.block_size = config, block_size
        # scheduler side
        self._asked: dict[int, float] = {}  # seq_id -> when it first asked for a remote KV (the load timeout)
        self._loaded: set[int] = set()  # seq_ids whose remote K/V were loaded once (a recompute starts over)
        self._loads: list[tuple] = []  # (seq, start, end) allocated this step
        self._saved_upto: dict[int, int] = {}  # seq_id -> prompt positions saved so far
        self.num_load_failures = 0
        self.num_send_timeouts = 0
        # worker side
        self.meta: KVConnectorMetadata | None = None
        self.stats = KVTransferStats()

    # ---- requests --------------------------------------------------------------------------------

    @staticmethod
    def _key(seq, p: dict) -> str:
        return transfer_key(p["transfer_id"], seq.prompt_ids)

    # ---- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed: int) -> int | None:
        p = remote_params(seq)
        if not p or not p.get("do_remote_prefill") or seq.seq_id in self._loaded:
            return 0
        # the model computes the prompt's last token here: its logits give the first new token
        want = len(seq.prompt_ids) - 1
        if want <= num_computed:
            return 0
        key = self._key(seq, p)
        found = self.lookup(key, seq)
        if found is None:
            first = self._asked.setdefault(seq.seq_id, time.monotonic())
            if time.monotonic() - first >= self.config.kv_load_timeout:
                self._asked.pop(seq.seq_id, None)
                self.num_load_failures += 1
                raise KVTransferError(f"the remote KV of transfer {p['transfer_id']!r} ({key}) did not arrive within "
                                      f"kv_load_timeout={self.config.kv_load_timeout} s ({self.where()})")
            return None
        self._asked.pop(seq.seq_id, None)
        if found < len(seq.prompt_ids):
            raise KVTransferError(f"transfer {key} holds {found} tokens, the prompt has {len(seq.prompt_ids)}")
        return want - num_computed

    def forget(self, seq) -> None:
        """The sequence gives up on its remote K/V (policy "recompute"): from now on it is prefilled here."""
        self._asked.pop(seq.seq_id, None)
        self._loaded.add(seq.seq_id)

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            start = seq.num_computed_tokens
            self._loads.append((seq, start, start + num_external_tokens))
            self._loaded.add(seq.seq_id)

    def build_connector_meta(self, scheduled, block_tables: dict[int, list[int]]) -> KVConnectorMetadata | None:
        meta, bs = KVConnectorMetadata(), self.block_size
        for seq, start, end in self._loads:
            if seq.seq_id in block_tables:  # (preempted in the same step: nothing to load into)
                p = remote_params(seq)
                meta.loads.append(ReqLoad(self._key(seq, p), start, end, slots_of(block_tables[seq.seq_id], bs, start, end),
                                          self.load_source(self._key(seq, p))))
        self._loads = []
        for seq, n in scheduled:
            p = remote_params(seq)
            # a one-token prompt has nothing to send: the consumer computes its only token itself
            if not p or not p.get("do_remote_decode") or len(seq.prompt_ids) <= 1:
                continue
            num_prompt = len(seq.prompt_ids)
            start = self._saved_upto.get(seq.seq_id, 0)  # prefix-cache hits were not computed: saved from the cache
            end = min(seq.num_computed_tokens + n, num_prompt)
            if end > start:
                meta.saves.append(ReqSave(self._key(seq, p), start, end,
                                          slots_of(block_tables[seq.seq_id], bs, start, end), num_prompt,
                                          end == num_prompt))
                self._saved_upto[seq.seq_id] = end
        return meta if meta.has_work else None

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        """-> (delay_free, kv_transfer_params for the response). The push store keeps nothing: its saves
        were finished by the step's wait_for_save."""
        self._asked.pop(seq.seq_id, None)
        self._loaded.discard(seq.seq_id)
        saved = self._saved_upto.pop(seq.seq_id, 0)
        p = remote_params(seq)
        if not p or not p.get("do_remote_decode"):
            return False, None
        if len(seq.prompt_ids) <= 1 and seq.finish_reason not in ("abort", "error"):  # nothing to send
            return False, {"do_remote_prefill": True, "transfer_id": p["transfer_id"]}
        key = self._key(seq, p)
        if saved < len(seq.prompt_ids) or seq.finish_reason in ("abort", "error"):  # nothing whole to publish
            self.discard(key)
            return False, None
        return self.sent(seq, key, block_ids), {"do_remote_prefill": True, "transfer_id": p["transfer_id"]}

    def get_finished(self) -> set[int]:
        return set()

    # ---- what a transport says -----------------------------------------------------------------

    @abstractmethod
    def lookup(self, key: str, seq) -> int | None:
        """Tokens the remote side holds under key, or None if nothing (yet)."""

    def load_source(self, key: str) -> dict:
        return {}

    def sent(self, seq, key: str, block_ids: list[int]) -> bool:
        """The producer's prompt is complete and published: whether its blocks must stay (pull)."""
        return False

    def discard(self, key: str) -> None:
        """An unfinished transfer: drop what was saved (nothing, by default)."""
        return None

    def where(self) -> str:
        return f"kv_path {self.config.kv_path!r}"

    # ---- worker side -----------------------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(self, model, cache) -> None: ...

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        self.meta = meta

    def clear_connector_metadata(self) -> None:
        self.meta = None

    @abstractmethod
    def start_load_kv(self) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer, k_cache, v_cache, attn_metadata) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def check_layers(self, model) -> list:
        """The model's cache layers, each of which must call the connector's layer hooks."""
        layers = cache_layers(model)
        for i, layer in enumerate(layers):
            if not getattr(layer, "kv_connector_hooks", False):
                raise ValueError(f"cache layer {i} ({type(layer).__name__}) does not call a KV connector's layer "
                                 "hooks; disaggregated serving supports the standard attention layer only")
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        return layers

    def shutdown(self) -> None:
        """Let go of what the worker side holds (threads, shared memory; nothing, by default)."""
        return None

    def take_stats(self) -> KVTransferStats:
        stats, self.stats = self.stats, KVTransferStats()
        return stats
