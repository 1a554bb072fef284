"""KVOffloadStore: the pinned CPU memory of the KV offload tier, and its copies (chapter 15).

The engine decides which GPU block goes to which CPU slot and back (engine/kv_offload.py); this file
moves the bytes. A slot holds one GPU block of *every* layer, K and V, side by side as raw bytes:

    pool: [num_slots, block_bytes] uint8, pinned        block_bytes = sum over the layers' K and V of
                                                        block_size x kv_heads x head_size x element size
    a layer tensor, viewed flat: [num_blocks, w] uint8  (w: its share of block_bytes, at offset `off`)

so a block's whole K/V is one contiguous row, and a run of consecutive slots is one DMA. Per step, all
of its saves and restores together (`transfer`):

    save     one gather per layer tensor  GPU blocks -> a GPU staging row each   [n, block_bytes]
             then one device-to-host copy per run of consecutive slots            staging -> pool
    restore  one host-to-device copy per run of consecutive slots                 pool -> staging
             then one scatter per layer tensor                                    staging -> GPU blocks

never a copy per block per layer. On a GPU the copies run on a side stream, which first waits for the
work already queued (the forward pass that wrote the blocks); the step's stream then waits on an event
(a wait on the device: the host goes on launching the forward pass). A step that only saves lets the
device-to-host copies run beside its forward pass, since only the gather must finish before the step
writes into a block just handed out again. Pinned memory is what lets those copies run asynchronously
at the link's speed; pageable memory would be staged through a driver buffer, synchronously.
On a CPU it is all plain copies.
"""

from __future__ import annotations

import torch


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(row, slot) pairs -> (first row, first slot, length) of each maximal run in which both go up by
    one: rows i..i+n of a staging buffer and slots j..j+n, one copy."""
    out: list[tuple[int, int, int]] = []
    for i, j in pairs:
        if out and out[-1][0] + out[-1][2] == i and out[-1][1] + out[-1][2] == j:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, j, 1))
    return out


class KVOffloadStore:
    def __init__(self, k_caches: list, v_caches: list, num_slots: int):
        self.k_caches, self.v_caches = k_caches, v_caches  # the PagedKVCache's lists (shared, not copied)
        flat = self._flat()
        self.device = flat[0].device
        self.widths = [t.shape[1] for t in flat]
        self.block_bytes = sum(self.widths)
        self.num_slots = num_slots
        cuda = self.device.type == "cuda"
        self.pool = torch.empty((num_slots, self.block_bytes), dtype=torch.uint8, pin_memory=cuda)  # [S, bytes]
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def _flat(self) -> list[torch.Tensor]:
        """Each layer's K and V as [num_blocks, bytes per block] uint8 views (an fp8 cache too)."""
        ts = [t for t in self.k_caches + self.v_caches if t is not None]
        return [t.view(torch.uint8).view(t.shape[0], -1) for t in ts]

    def transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """saves: (GPU block, slot), loads: (slot, GPU block); in the order engine/kv_offload.py states
        (read the saved blocks, write their slots, then the restores). Slots in saves are distinct."""
        if not saves and not loads:
            return
        if self.stream is None:
            self._run(saves, loads, self._flat())
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the blocks to save were written by work already queued
        with torch.cuda.stream(self.stream):
            # buffers allocated here belong to the side stream: reused only after its queued copies
            gathered = self._run(saves, loads, self._flat())
        main.wait_event(gathered)

    def _run(self, saves, loads, flat) -> torch.cuda.Event | None:
        cuda = self.stream is not None
        gathered = None
        if saves:
            src = torch.tensor([b for b, _ in saves], dtype=torch.int64).to(self.device, non_blocking=cuda)
            out = torch.empty((len(saves), self.block_bytes), dtype=torch.uint8, device=self.device)
            off = 0
            for t, w in zip(flat, self.widths):
                out[:, off : off + w] = t.index_select(0, src)  # [n, w]: every saved block of one tensor
                off += w
            if cuda and not loads:  # the step only has to wait for the gather; the D2H copies overlap it
                gathered = torch.cuda.Event()
                gathered.record()
            for i, j, n in runs([(i, s) for i, (_, s) in enumerate(saves)]):
                self.pool[j : j + n].copy_(out[i : i + n], non_blocking=cuda)
        if loads:
            rows = torch.empty((len(loads), self.block_bytes), dtype=torch.uint8, device=self.device)
            for i, j, n in runs([(i, s) for i, (s, _) in enumerate(loads)]):
                rows[i : i + n].copy_(self.pool[j : j + n], non_blocking=cuda)
            dst = torch.tensor([b for _, b in loads], dtype=torch.int64).to(self.device, non_blocking=cuda)
            off = 0
            for t, w in zip(flat, self.widths):
                t.index_copy_(0, dst, rows[:, off : off + w])  # [n, w] into the restored blocks
                off += w
        if cuda and gathered is None:
            gathered = torch.cuda.Event()
            gathered.record()
        return gathered
