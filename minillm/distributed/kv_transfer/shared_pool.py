"""SharedPoolConnector: the consumer copies a prompt's K/V straight out of the producer's own KV pool
(chapter 17; the pull model of vLLM's NixlConnector and of Mooncake, on one machine).

The producer's pool is shared memory from the start: on a CPU every layer's pool tensor lives in a
file under kv_path (an mmap both processes see; under /dev/shm it never touches a disk), on one GPU
its CUDA IPC handles are written there (torch's `reduce_tensor`), so the consumer maps the very same
device memory. Nothing is copied at the producer. When a prompt is done, request_finished publishes
its block ids and asks the scheduler to keep the blocks (delay_free): the consumer copies them, row
by row, into its own blocks inside its forward pass (layer i's copy is queued on a side stream while
layer i - 1 attends; on a CPU it runs in wait_for_layer_load), then writes `<key>.done`, and the
producer frees them at its next step.

Who may touch the blocks is settled by one atomic file create (O_EXCL), `<key>.claim`: the consumer
claims before it copies; a producer whose kv_send_timeout ran out claims too, and only if it wins
does it free the blocks (a consumer that then comes finds the transfer gone: a clear error). A
consumer that claimed and died is waited for twice the timeout, then the blocks are freed anyway.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import time

import torch

from .base import KVConnectorBase, KVTransferError, log_transfer, remote_params, slots_of
from .layout import layout_mismatch, layout_of, row_view

logger = logging.getLogger(__name__)


def _create_excl(path: str) -> bool:
    """Create path if nobody has: the one atomic step both sides agree on."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


class SharedPoolConnector(KVConnectorBase):
    def __init__(self, config, block_size: int, specs):
        super().__init__(config, block_size)
        os.makedirs(config.kv_path, exist_ok=True)
        self.layout = layout_of(list(specs))
        self.pool_id = f"pool-{os.getpid()}"  # the scheduler and its worker share this process
        self._pending: dict[int, tuple[str, float]] = {}  # seq_id -> (key, when published)
        self._pools: dict[str, tuple[list, list]] = {}  # a consumer's mapped producer pools
        self._shared_dir: str | None = None
        self._claimed: set[str] = set()  # a consumer's transfers it has the right to copy

    def _path(self, name: str) -> str:
        return os.path.join(self.config.kv_path, name)

    # ---- scheduler side ----------------------------------------------------------------------------

    def lookup(self, key: str, seq) -> int | None:
        try:
            with open(self._path(key + ".json")) as f:
                meta = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if (why := layout_mismatch(self.layout, meta)) is not None:
            raise KVTransferError(f"transfer {key} was prefilled by another model's cache: {why}")
        # claimed before any block is allocated for it, so that losing the race fails this request alone
        if key not in self._claimed:
            if not _create_excl(self._path(key + ".claim")):
                raise KVTransferError(f"transfer {key} was given up by its producer (kv_send_timeout) before this "
                                      "consumer took it")
            self._claimed.add(key)
        return meta["num_tokens"]

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        out = super().request_finished(seq, block_ids)
        p = remote_params(seq)
        if p and p.get("do_remote_prefill") and (key := self._key(seq, p)) in self._claimed:
            self._claimed.discard(key)
            _create_excl(self._path(key + ".done"))  # (loaded or not) the producer may free its blocks now
        return out

    def load_source(self, key: str) -> dict:
        with open(self._path(key + ".json")) as f:
            meta = json.load(f)
        return {"pool": meta["pool"], "blocks": meta["blocks"], "block_size": meta["block_size"]}

    def sent(self, seq, key: str, block_ids: list[int]) -> bool:
        meta = {"pool": self.pool_id, "blocks": list(block_ids), "block_size": self.block_size,
                "num_tokens": len(seq.prompt_ids), **self.layout}
        for suffix in (".claim", ".done"):  # a transfer id used again: the old marks are not this one's
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key + suffix))
        tmp = self._path(key + ".json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, self._path(key + ".json"))  # atomic: a consumer never reads half of it
        self._pending[seq.seq_id] = (key, time.monotonic())
        return True

    def get_finished(self) -> set[int]:
        done, now, timeout = set(), time.monotonic(), self.config.kv_send_timeout
        for seq_id, (key, since) in list(self._pending.items()):
            if os.path.exists(self._path(key + ".done")):
                pass  # the consumer has its copy
            elif now - since < timeout:
                continue
            elif not _create_excl(self._path(key + ".claim")) and now - since < 2 * timeout:
                continue  # a consumer is copying: wait for it (up to twice the timeout)
            else:
                self.num_send_timeouts += 1
                logger.warning("no consumer took KV transfer %s within kv_send_timeout=%s s: its blocks are freed",
                               key, timeout)
            for suffix in (".json", ".claim", ".done"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(key + suffix))
            del self._pending[seq_id]
            done.add(seq_id)
        return done

    # ---- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, model, cache) -> None:
        self.check_layers(model)
        self.device = cache.device
        if self.config.is_producer:  # the pool becomes shared memory before the model is bound to it
            self._share_pool(cache)
        self.k_rows = [row_view(k) for k in cache.k_caches]
        self.v_rows = [row_view(v) if v is not None else None for v in cache.v_caches]

    def _share_pool(self, cache) -> None:
        handles = {"transport": "cuda_ipc" if self.device.type == "cuda" else "shm", "k": [], "v": []}
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            from .cuda_ipc import export_pool

            handles = export_pool(cache.k_caches, cache.v_caches, reduce_tensor)
        else:
            self._shared_dir = self._path(self.pool_id)
            os.makedirs(self._shared_dir, exist_ok=True)
            for name, tensors in (("k", cache.k_caches), ("v", cache.v_caches)):
                for i, t in enumerate(tensors):
                    if t is None:
                        handles[name].append(None)
                        continue
                    path = os.path.join(self._shared_dir, f"{name}{i}")
                    shared = _mapped(path, t.shape, t.dtype)
                    shared.copy_(t)
                    tensors[i] = shared  # the pool is now the mapped file
                    handles[name].append((path, tuple(t.shape), str(t.dtype)))
        self._publish_pool(handles)

    def _publish_pool(self, handles: dict) -> None:
        with open(self._path(self.pool_id + ".pool.tmp"), "wb") as f:
            pickle.dump(handles, f)
        os.replace(self._path(self.pool_id + ".pool.tmp"), self._path(self.pool_id + ".pool"))

    def _read_handles(self, pool_id: str) -> dict:
        try:
            with open(self._path(pool_id + ".pool"), "rb") as f:
                return pickle.load(f)  # written by our producer (trusted as kv_path is)
        except FileNotFoundError:
            raise KVTransferError(f"producer pool {pool_id} is gone from {self.config.kv_path!r}") from None

    def _open_pool(self, pool_id: str) -> tuple[list, list]:
        """A producer's pool as [slots, row_bytes] uint8 views, mapped once per producer."""
        if pool_id not in self._pools:
            handles = self._read_handles(pool_id)
            if handles["transport"] == "cuda_ipc":  # the producer's device memory, mapped into this process
                from .cuda_ipc import open_pool

                self._pools[pool_id] = open_pool(handles, pool_id, self.device)
            else:
                def open_one(h):
                    return row_view(_mapped(h[0], h[1], _dtype(h[2]))) if h is not None else None

                self._pools[pool_id] = ([open_one(h) for h in handles["k"]], [open_one(h) for h in handles["v"]])
        return self._pools[pool_id]

    def start_load_kv(self) -> None:
        if self.meta is None or not self.meta.loads:
            return
        self._t_load, self._jobs = time.perf_counter(), []
        for ld in self.meta.loads:
            src_k, src_v = self._open_pool(ld.source["pool"])
            src = slots_of(ld.source["blocks"], ld.source["block_size"], ld.start, ld.end)  # [n] the producer's rows
            self._jobs.append((ld.key, src_k, src_v, self._plan(src, ld.slots), len(src)))
        self._events = None
        if self.device.type == "cuda":  # every layer's copy queued now on a side stream, one event a layer
            side, self._events = torch.cuda.Stream(), []
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._first = torch.cuda.Event(enable_timing=True)
                self._first.record()
                for i in range(len(self.k_rows)):
                    self._copy_layer(i)
                    self._events.append(torch.cuda.Event(enable_timing=True))
                    self._events[-1].record()

    def _plan(self, src: list[int], dst: list[int]):
        """How one load's rows are copied, worked out once per step for every layer: index tensors."""
        return (torch.tensor(src, dtype=torch.long, device=self.device),  # [n] the producer's rows
                torch.tensor(dst, dtype=torch.long, device=self.device))  # [n] ours

    def _copy(self, src_rows, dst_rows, plan) -> None:
        src, dst = plan
        dst_rows.index_copy_(0, dst, src_rows.index_select(0, src))  # [n, row_bytes]: a gather, then a scatter

    def _copy_layer(self, i: int) -> None:
        for _, src_k, src_v, plan, n in self._jobs:
            self._copy(src_k[i], self.k_rows[i], plan)
            self.stats.bytes_loaded += n * self.k_rows[i].shape[1]
            if self.v_rows[i] is not None:
                self._copy(src_v[i], self.v_rows[i], plan)
                self.stats.bytes_loaded += n * self.v_rows[i].shape[1]

    def wait_for_layer_load(self, layer) -> None:
        if self.meta is None or not self.meta.loads:
            return
        i = self._index[id(layer)]
        if self._events is not None:
            torch.cuda.current_stream().wait_event(self._events[i])  # the GPU waits, not the host
        else:
            self._copy_layer(i)

    def save_kv_layer(self, layer, k_cache, v_cache, attn_metadata) -> None:
        return None  # nothing to push: the consumer reads the producer's pool itself

    def wait_for_save(self) -> None:
        if self.meta is None or not self.meta.loads:
            return
        seconds = time.perf_counter() - self._t_load
        if self._events is not None:
            self._events[-1].synchronize()  # our copies are done: the producer may reuse its blocks
            seconds = self._first.elapsed_time(self._events[-1]) / 1e3  # the copies' own time on the device
        for key, *_ in self._jobs:
            _create_excl(self._path(key + ".done"))
        self.stats.transfers_loaded += len(self._jobs)
        self.stats.seconds_loading += seconds
        log_transfer("loaded", len(self._jobs), self.stats.bytes_loaded, seconds)

    def shutdown(self) -> None:
        self._pools.clear()
        if self._shared_dir is not None:
            shutil.rmtree(self._shared_dir, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(self.pool_id + ".pool"))


def _mapped(path: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of this shape and dtype backed by a shared file mapping (created if missing)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(dtype).view(shape)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))

