"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters added and removed while the server
runs (chapter 16; vLLM's endpoints and bodies). Off unless `--lora-root DIR` is given, and then only
for folders inside DIR: a client names a folder, and without the fence it could make the server read
any path it can (a PEFT loader opens two files there). The path is resolved with every symlink
followed before it is compared, so neither `..` nor a link leads out.

A loaded adapter is read and checked in full here, against the model's layers (the engine's
LoRAManager targets, which the engine core sends with its view), before its name is served; a bad
one is a 400 naming what is wrong, and nothing changes. Each load gets a new lora_int_id, never
reused: a name unloaded and loaded again from another folder is another adapter to the GPU slots and
the prefix cache. Unloading stops new requests from naming it; requests already running finish with it.
"""

from __future__ import annotations

import asyncio
import itertools
import os

from ...lora.adapter import load_adapter
from ...lora.request import LoRARequest
from .serving_engine import APIError


class OpenAIServingLoRA:
    def __init__(self, engine, model_name: str, lora_modules: dict[str, LoRARequest], lora_root: str):
        self.engine, self.model_name, self.lora_modules = engine, model_name, lora_modules
        self.root = os.path.realpath(lora_root)
        self._ids = itertools.count(max((r.lora_int_id for r in lora_modules.values()), default=0) + 1)
        self._lock = asyncio.Lock()  # one load at a time: a name is checked and taken together

    def resolve(self, lora_path: str) -> str:
        """lora_path (relative to the root, or absolute) -> its real path, which must lie inside the root."""
        path = os.path.realpath(os.path.join(self.root, lora_path))
        if os.path.commonpath([self.root, path]) != self.root:
            raise APIError(400, f"lora_path {lora_path!a} is outside the folder this server loads adapters from "
                           "(--lora-root)", param="lora_path")
        return path

    async def load(self, lora_name: str, lora_path: str) -> dict:
        self.engine.check_ready()
        if not lora_name or lora_name == self.model_name:
            raise APIError(400, f"lora_name {lora_name!a} must be a non-empty name other than the base model's",
                           param="lora_name")
        path = self.resolve(lora_path)
        built = self.engine.engine
        targets = getattr(built, "lora_targets", None)  # the core process's view carries them
        if targets is None:
            targets = built.lora.targets  # an engine in this process
        async with self._lock:
            if lora_name in self.lora_modules:
                raise APIError(400, f"the adapter {lora_name!a} is loaded already; unload it first",
                               param="lora_name", code="lora_exists")
            request = LoRARequest(lora_name, next(self._ids), path)
            try:  # read from disk and checked: off the event loop
                await asyncio.to_thread(load_adapter, request, targets, built.config.max_lora_rank)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path") from None
            self.lora_modules[lora_name] = request
        return {"lora_name": lora_name, "lora_int_id": request.lora_int_id}

    def unload(self, lora_name: str) -> dict:
        if self.lora_modules.pop(lora_name, None) is None:
            raise APIError(404, f"no adapter named {lora_name!a} is loaded", param="lora_name", code="not_found")
        return {"lora_name": lora_name}
