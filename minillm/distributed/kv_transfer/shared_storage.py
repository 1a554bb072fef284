"""SharedStorageConnector: the producer writes each layer's K/V to a file store as it computes them,
the consumer reads them back layer by layer (chapter 17; vLLM has a connector of this name).

Saving (producer): attention layer i, right after writing its new K/V into the paged cache, gathers
the rows of the tokens to save (a copy on the device) and queues them; a writer thread writes them
to the layer's file while layers i+1, i+2, ... compute. On a GPU the rows go to pinned host memory on
the step's stream, and the writer waits for that copy's event, not for the whole step. wait_for_save,
after the forward pass, waits for the queue to drain and publishes every prompt completed this step
(meta.json): a consumer can never read a half-written transfer.

Loading (consumer): start_load_kv starts a reader thread that reads every layer's rows in layer order;
attention layer i waits only for layer i's (wait_for_layer_load), scatters them into its blocks'
slots and attends, while the reader is already on layer i + 1.

Push, so the producer frees its blocks as soon as the request ends (request_finished: no delay); what
nobody picks up stays in the store until kv_send_timeout, when the producer's reaper deletes it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import torch

from .base import KVConnectorBase, KVTransferError, log_transfer
from .layout import layout_mismatch, layout_of, row_view
from .store import FileStore

logger = logging.getLogger(__name__)
REAP_EVERY = 1.0  # seconds between the producer's looks for transfers nobody picked up


class SharedStorageConnector(KVConnectorBase):
    def __init__(self, config, block_size: int, specs):
        super().__init__(config, block_size)
        self.store = FileStore(config.kv_path)
        self.layout = layout_of(list(specs))
        self._next_reap = 0.0
        self._writer: threading.Thread | None = None
        self._reader: threading.Thread | None = None

    # ---- scheduler side ----------------------------------------------------------------------------

    def lookup(self, key: str, seq) -> int | None:
        meta = self.store.read_meta(key)
        if meta is None:
            return None
        if (why := layout_mismatch(self.layout, meta)) is not None:
            raise KVTransferError(f"transfer {key} was saved by another model's cache: {why}")
        return meta["num_tokens"]

    def discard(self, key: str) -> None:
        self.store.discard(key)

    def get_finished(self) -> set[int]:
        # nothing is held back (push); meanwhile, the producer deletes what nobody picked up in time
        if self.config.is_producer and (now := time.monotonic()) >= self._next_reap:
            self._next_reap = now + REAP_EVERY
            gone = self.store.expire(self.config.kv_send_timeout)
            if gone:
                self.num_send_timeouts += len(gone)
                logger.warning("no consumer picked up %d KV transfer(s) within kv_send_timeout=%s s; deleted: %s",
                               len(gone), self.config.kv_send_timeout, ", ".join(gone[:4]))
        return set()

    # ---- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, model, cache) -> None:
        self.check_layers(model)
        self.k_rows = [row_view(k) for k in cache.k_caches]  # [slots, row_bytes] uint8 views of the pool
        self.v_rows = [row_view(v) if v is not None else None for v in cache.v_caches]
        self.device = cache.device

    def bind_connector_metadata(self, meta) -> None:
        super().bind_connector_metadata(meta)
        dev = self.device
        # the slots once per step, on the device: every layer gathers / scatters the same rows
        self._save_slots = [torch.tensor(s.slots, dtype=torch.long, device=dev) for s in meta.saves]
        self._load_slots = [torch.tensor(ld.slots, dtype=torch.long, device=dev) for ld in meta.loads]
        self._t_save = None

    def _offsets(self, layer: int, num_tokens: int, start: int) -> tuple[int, int]:
        """Byte offsets of position `start`'s K row and V row in a layer's file."""
        kb = self.k_rows[layer].shape[1]
        vb = self.v_rows[layer].shape[1] if self.v_rows[layer] is not None else 0
        return start * kb, num_tokens * kb + start * vb

    # saving

    def save_kv_layer(self, layer, k_cache, v_cache, attn_metadata) -> None:
        if self.meta is None or not self.meta.saves:
            return
        i = self._index[id(layer)]
        if self._writer is None:
            self._t_save, self._errors = time.perf_counter(), []
            self._queue: queue.Queue = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="kv-save", daemon=True)
            self._writer.start()
        cuda = self.device.type == "cuda"
        for save, slots in zip(self.meta.saves, self._save_slots):
            ko, vo = self._offsets(i, save.num_tokens, save.start)
            for rows, offset in ((self.k_rows[i], ko), (self.v_rows[i], vo)):
                if rows is None:
                    continue
                picked = rows.index_select(0, slots)  # [n, row_bytes] a copy: the cache may move on
                event = None
                if cuda:  # to pinned host memory on this stream; the writer waits for just this copy
                    host = torch.empty(picked.shape, dtype=torch.uint8, pin_memory=True)
                    host.copy_(picked, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    picked = host
                self._queue.put((save.key, i, picked, offset, event))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, layer, rows, offset, event = item
                if event is not None:
                    event.synchronize()
                fd = self.store.open_layer(key, layer)
                try:
                    self.stats.bytes_saved += self.store.write_rows(fd, rows.numpy(), offset)
                finally:
                    os.close(fd)
            except Exception as e:  # reported by wait_for_save, in the step's thread
                self._errors.append(e)
            finally:
                self._queue.task_done()

    def wait_for_save(self) -> None:
        if self._writer is None:
            return
        self._queue.put(None)
        self._writer.join()
        self._writer = None
        if self._errors:
            raise KVTransferError(f"saving KV to {self.config.kv_path!r} failed: {self._errors[0]}")
        done = [s for s in self.meta.saves if s.last]
        for save in done:
            self.store.commit(save.key, {"num_tokens": save.num_tokens, **self.layout})
        seconds = time.perf_counter() - self._t_save
        self.stats.transfers_saved += len(done)
        self.stats.seconds_saving += seconds
        log_transfer("saved", len(done), self.stats.bytes_saved, seconds)

    # loading

    def start_load_kv(self) -> None:
        if self.meta is None or not self.meta.loads:
            return
        n = len(self.k_rows)
        self._landed = [threading.Event() for _ in range(n)]
        self._layer_rows: list = [None] * n
        self._load_error: Exception | None = None
        self._t_load = time.perf_counter()
        self._reader = threading.Thread(target=self._read_loop, args=(list(self.meta.loads),), name="kv-load",
                                        daemon=True)
        self._reader.start()

    def _read_loop(self, loads) -> None:
        try:
            sizes = []
            for ld in loads:
                meta = self.store.read_meta(ld.key)
                if meta is None:
                    raise KVTransferError(f"transfer {ld.key} vanished from {self.config.kv_path!r} before it was "
                                          "loaded (kv_send_timeout on the producer?)")
                sizes.append(meta["num_tokens"])
            for i in range(len(self.k_rows)):
                got = []
                for ld, num_tokens in zip(loads, sizes):
                    ko, vo = self._offsets(i, num_tokens, ld.start)
                    n = ld.end - ld.start
                    k = torch.from_numpy(self.store.read_rows(ld.key, i, ko, n, self.k_rows[i].shape[1]))
                    v = None
                    if self.v_rows[i] is not None:
                        v = torch.from_numpy(self.store.read_rows(ld.key, i, vo, n, self.v_rows[i].shape[1]))
                    got.append((k, v))
                self._layer_rows[i] = got
                self._landed[i].set()
        except Exception as e:
            self._load_error = e
            for ev in self._landed:
                ev.set()

    def wait_for_layer_load(self, layer) -> None:
        if self.meta is None or not self.meta.loads:
            return
        i = self._index[id(layer)]
        self._landed[i].wait()
        if self._load_error is not None:
            raise KVTransferError(f"loading KV from {self.config.kv_path!r} failed: {self._load_error}")
        for (k, v), slots in zip(self._layer_rows[i], self._load_slots):
            self.k_rows[i].index_copy_(0, slots, k.to(self.device, non_blocking=True))  # [n, row_bytes]
            self.stats.bytes_loaded += k.numel()
            if v is not None:
                self.v_rows[i].index_copy_(0, slots, v.to(self.device, non_blocking=True))
                self.stats.bytes_loaded += v.numel()
        self._layer_rows[i] = None
        if i == len(self.k_rows) - 1:
            self._reader.join()
            self._reader = None
            seconds = time.perf_counter() - self._t_load
            self.stats.transfers_loaded += len(self.meta.loads)
            self.stats.seconds_loading += seconds
            log_transfer("loaded", len(self.meta.loads), self.stats.bytes_loaded, seconds)

    def clear_connector_metadata(self) -> None:
        if self._writer is not None:  # the step failed between a save and wait_for_save: stop the writer
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        super().clear_connector_metadata()

