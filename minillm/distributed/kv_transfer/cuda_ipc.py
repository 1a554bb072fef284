"""CudaIpcConnector: two engine processes on one GPU; the consumer copies the blocks it needs straight
out of the producer's device memory (chapter 17; the one-GPU case of vLLM's P2P/NIXL connectors).

The producer exports its KV pool once, at start-up: every layer's K and V cache tensor becomes a CUDA
IPC handle (torch's `reduce_tensor`: a cudaIpcMemHandle of the allocation, the offset, shape, stride,
dtype) written beside the pool's shape under kv_path. The consumer opens the handles once per producer
(`cudaIpcOpenMemHandle`: the same device memory, mapped into its address space) and from then on a
transfer is a device-to-device copy, never through the host:

    producer  request_finished -> publish <key>.json {pool, block ids, layout}; keep the blocks (delay_free)
    consumer  lookup: claim <key> (O_EXCL) -> allocate blocks -> forward pass:
              start_load_kv: plan the rows as runs (kernels/kv_block_copy.py), queue layer 0, 1, ...'s copies
                             on a side stream, one event per layer
              wait_for_layer_load(i): the compute stream waits for layer i's event (the GPU waits, not the host)
              wait_for_save: every copy landed -> <key>.done: the producer frees the blocks at its next step

The claim/done/timeout protocol is SharedPoolConnector's (shared_pool.py); what this class adds is the
transport alone: handles checked on the way in (a pool of another shape, another device), the one-pass
run copy instead of a gather + scatter, and a clear refusal on a machine without CUDA.

`export_pool` and `open_pool` take the tensor reducer as an argument, so the handle protocol runs on a
CPU in the tests with a fake in place of `reduce_tensor`.
"""

from __future__ import annotations

import os

import torch

from .base import KVTransferError
from .layout import row_view
from .shared_pool import SharedPoolConnector


def export_pool(k_caches: list, v_caches: list, reduce) -> dict:
    """The pool's handles: reduce(tensor) -> (rebuild, args) per layer (None for a layer without V),
    with the shapes and dtype the consumer checks what it opens against."""
    first = k_caches[0]
    return {"transport": "cuda_ipc", "pid": os.getpid(), "device": str(first.device), "dtype": str(first.dtype),
            "k": [reduce(t) for t in k_caches], "v": [reduce(t) if t is not None else None for t in v_caches],
            "k_shapes": [tuple(t.shape) for t in k_caches],
            "v_shapes": [tuple(t.shape) if t is not None else None for t in v_caches]}


def open_pool(handles: dict, pool_id: str, device: torch.device) -> tuple[list, list]:
    """The producer's pool as [slots, row_bytes] uint8 row views, mapped into this process."""
    if handles.get("transport") != "cuda_ipc":
        raise KVTransferError(f"producer pool {pool_id} shares its KV by {handles.get('transport')!r}, not CUDA IPC: "
                              "both engines must run the same kv_connector")
    if device.type == "cuda" and handles["device"] != str(device):  # (torch maps a handle onto its own device)
        raise KVTransferError(f"producer pool {pool_id} is on {handles['device']}, this consumer on {device}: "
                              "CUDA IPC here joins two processes on one GPU")

    def open_one(h, shape, what):
        if h is None:
            return None
        t = h[0](*h[1])  # cudaIpcOpenMemHandle, once per producer
        if tuple(t.shape) != tuple(shape) or str(t.dtype) != handles["dtype"]:
            raise KVTransferError(f"producer pool {pool_id}: {what} opened as {t.dtype}{tuple(t.shape)}, exported as "
                                  f"{handles['dtype']}{tuple(shape)}")
        return row_view(t)

    k = [open_one(h, s, f"K layer {i}") for i, (h, s) in enumerate(zip(handles["k"], handles["k_shapes"]))]
    v = [open_one(h, s, f"V layer {i}") for i, (h, s) in enumerate(zip(handles["v"], handles["v_shapes"]))]
    return k, v


def _reduce_tensor(t: torch.Tensor):
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(t)


class CudaIpcConnector(SharedPoolConnector):
    reduce = staticmethod(_reduce_tensor)  # a test puts a fake here (and sets needs_cuda False)
    needs_cuda = True

    def register_kv_caches(self, model, cache) -> None:
        if self.needs_cuda and cache.device.type != "cuda":
            raise ValueError(f"CudaIpcConnector shares a GPU's KV pool by CUDA IPC, and this engine's cache is on "
                             f"{cache.device}; on a CPU use SharedPoolConnector (shared memory) or "
                             "SharedStorageConnector (files)")
        super().register_kv_caches(model, cache)

    def _share_pool(self, cache) -> None:
        self._publish_pool(export_pool(cache.k_caches, cache.v_caches, self.reduce))

    def _open_pool(self, pool_id: str) -> tuple[list, list]:
        if pool_id not in self._pools:
            self._pools[pool_id] = open_pool(self._read_handles(pool_id), pool_id, self.device)
        return self._pools[pool_id]

    def _plan(self, src: list[int], dst: list[int]):
        from ...kernels.kv_block_copy import copy_runs

        return torch.from_numpy(copy_runs(src, dst)).to(self.device)  # [R, 3] (src row, dst row, rows)

    def _copy(self, src_rows, dst_rows, plan) -> None:
        from ...kernels.kv_block_copy import copy_rows

        copy_rows(src_rows, dst_rows, plan)  # each byte read once, written once
