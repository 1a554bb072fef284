"""The file store: one folder per transfer, one file per layer, written row by row (chapter 17).

    <kv_path>/<key>/layer_<i>.kv   K rows [num_tokens, row_bytes], then V rows (no V: MLA's latent)
    <kv_path>/<key>/meta.json      written last (by rename, so atomic): the transfer is complete

A row is one token's K (or V) in one layer, as the cache stores it (its dtype's bytes), so a prompt
prefilled in chunks is written chunk by chunk at each chunk's offset, and a consumer reads any range
of positions without reading the rest. meta.json names what the rows mean (layers, heads, head size,
dtype): a consumer with another model refuses them instead of decoding garbage.

Files work on every machine and in CI; on Linux a kv_path under /dev/shm makes them shared memory.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np

META = "meta.json"


class FileStore:
    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def _dir(self, key: str) -> str:
        return os.path.join(self.root, key)

    def layer_path(self, key: str, layer: int) -> str:
        return os.path.join(self._dir(key), f"layer_{layer}.kv")

    # ---- writing (producer) ------------------------------------------------------------------------

    def open_layer(self, key: str, layer: int) -> int:
        os.makedirs(self._dir(key), exist_ok=True)
        return os.open(self.layer_path(key, layer), os.O_WRONLY | os.O_CREAT, 0o644)

    @staticmethod
    def write_rows(fd: int, rows: np.ndarray, offset: int) -> int:
        """rows [n, row_bytes] uint8 at byte offset; -> bytes written."""
        data = memoryview(np.ascontiguousarray(rows)).cast("B")
        done = 0
        while done < len(data):  # pwrite may write less than asked
            done += os.pwrite(fd, data[done:], offset + done)
        return done

    def commit(self, key: str, meta: dict) -> None:
        tmp = os.path.join(self._dir(key), META + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**meta, "created": time.time()}, f)
        os.replace(tmp, os.path.join(self._dir(key), META))

    def discard(self, key: str) -> None:
        shutil.rmtree(self._dir(key), ignore_errors=True)

    def expire(self, max_age: float) -> list[str]:
        """Remove transfers older than max_age seconds (nobody picked them up); -> their keys."""
        gone, now = [], time.time()
        for key in os.listdir(self.root):
            meta = self.read_meta(key)
            if meta is not None and now - meta["created"] > max_age:
                self.discard(key)
                gone.append(key)
        return gone

    # ---- reading (consumer) ----------------------------------------------------------------------

    def read_meta(self, key: str) -> dict | None:
        try:
            with open(os.path.join(self._dir(key), META)) as f:
                return json.load(f)
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None

    def read_rows(self, key: str, layer: int, offset: int, n: int, row_bytes: int) -> np.ndarray:
        """-> [n, row_bytes] uint8 from byte offset of a layer's file."""
        data = bytearray(n * row_bytes)  # writable: torch.from_numpy takes it without a copy
        with open(self.layer_path(key, layer), "rb") as f:
            f.seek(offset)
            got = f.readinto(data)
        if got != len(data):
            raise OSError(f"{self.layer_path(key, layer)} is short: {got} of {len(data)} bytes at offset {offset}")
        return np.frombuffer(data, dtype=np.uint8).reshape(n, row_bytes)
