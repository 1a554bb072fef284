"""KVTransferConfig: which connector an engine runs, in which role, and where its KV goes (chapter 17;
vLLM's `--kv-transfer-config`), and the per-request handle (`kv_transfer_params`).

Disaggregated serving runs two engines: a *producer* that only prefills and a *consumer* that only
decodes. The router sends a prompt to the producer with one token to generate, then the same request
to the consumer with a handle that names the producer's KV cache; the consumer loads that K/V instead of
computing it. The handle travels in the request body (vLLM's `kv_transfer_params`):

    producer:  {"do_remote_decode": true,  "transfer_id": "abc123"}    compute the prompt, save its K/V
    consumer:  {"do_remote_prefill": true, "transfer_id": "abc123"}    load the prompt's K/V, then decode

A transfer is keyed by the transfer id *and* the prompt's token ids (`transfer_key`), so one handle
serves a request with several prompts, each finding its own K/V.

Nothing here imports torch or the engine: the server's API process checks a request's handle with it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ...checks import check_choice, check_float

KV_ROLES = ("producer", "consumer", "both")  # vLLM: kv_producer, kv_consumer, kv_both
KV_CONNECTORS = ("SharedStorageConnector", "SharedPoolConnector", "CudaIpcConnector")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a file name on every system, and no path


@dataclass
class KVTransferConfig:
    kv_connector: str = "SharedStorageConnector"  # KV_CONNECTORS: a file store (push), a shared pool or CUDA IPC (pull)
    kv_role: str = "both"  # producer saves, consumer loads, both does either per request
    kv_path: str = "/tmp/minillm_kv"  # the store's folder (SharedStorage) or the pool's rendezvous (SharedPool)
    # a consumer waits this long for a handle's K/V to appear (WAITING_FOR_REMOTE_KVS), then applies the policy
    kv_load_timeout: float = 30.0
    # "fail": the request ends with finish_reason "error" naming the transfer; "recompute": it is prefilled here
    kv_load_failure_policy: str = "fail"
    # a producer keeps what it saved this long for a consumer to pick up (the store's entry, the shared
    # pool's blocks), then lets it go and counts a timeout
    kv_send_timeout: float = 60.0

    def __post_init__(self):
        check_choice("kv_connector", self.kv_connector, KV_CONNECTORS)
        check_choice("kv_role", self.kv_role, KV_ROLES)
        if not isinstance(self.kv_path, str) or not self.kv_path:
            raise ValueError(f"kv_path must be a non-empty folder path, not {self.kv_path!r}")
        check_float("kv_load_timeout", self.kv_load_timeout, 0)
        check_float("kv_send_timeout", self.kv_send_timeout, 0)
        check_choice("kv_load_failure_policy", self.kv_load_failure_policy, LOAD_FAILURE_POLICIES)

    @classmethod
    def from_dict(cls, value) -> KVTransferConfig:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"kv_transfer_config must be a dict or a KVTransferConfig, not {type(value).__name__}")
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**value)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("consumer", "both")


def check_kv_transfer_params(params) -> dict | None:
    """A request's handle, checked: None, or {"do_remote_decode" | "do_remote_prefill": bool,
    "transfer_id": str}; a ValueError/TypeError names the field otherwise."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise TypeError(f"kv_transfer_params must be an object (dict), not {type(params).__name__}")
    allowed = {"do_remote_decode", "do_remote_prefill", "transfer_id"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"kv_transfer_params has unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    for name in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(name, False), bool):
            raise TypeError(f"kv_transfer_params.{name} must be true or false, not {params[name]!r}")
    decode, prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode (this engine prefills) and do_remote_prefill "
                         "(this engine decodes) exclude each other")
    tid = params.get("transfer_id")
    if (decode or prefill) and not (isinstance(tid, str) and _TRANSFER_ID.fullmatch(tid)):
        raise ValueError("kv_transfer_params.transfer_id must be 1-128 characters of A-Z a-z 0-9 _ . -, "
                         f"not {tid!r}")
    return params


def check_role(config: KVTransferConfig | None, params) -> None:
    """Refuse a handle this engine cannot serve: none without a connector, and only what its role does
    (ValueError naming it)."""
    p = check_kv_transfer_params(params)
    if not p:
        return
    if config is None:
        raise ValueError("kv_transfer_params needs an engine with a KV connector (kv_transfer_config; "
                         "`minillm serve --kv-connector NAME --kv-role producer|consumer`)")
    if p.get("do_remote_decode") and not config.is_producer:
        raise ValueError(f"kv_transfer_params.do_remote_decode asks this engine to save a prompt's KV, but its "
                         f"kv_role is {config.kv_role!r} (producer or both can)")
    if p.get("do_remote_prefill") and not config.is_consumer:
        raise ValueError(f"kv_transfer_params.do_remote_prefill asks this engine to load a prompt's KV, but its "
                         f"kv_role is {config.kv_role!r} (consumer or both can)")


def transfer_key(transfer_id: str, prompt_ids: list[int]) -> str:
    """The store's name for one prompt's K/V under a handle: the id and a hash of the prompt's tokens."""
    digest = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]
    return f"{transfer_id}-{digest}"
