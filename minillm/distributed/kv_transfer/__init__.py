"""KV transfer between engines: disaggregated prefill and decode (chapter 17; vLLM's
distributed/kv_transfer).

    config.py          KVTransferConfig (connector, role, path, timeouts) and the request's handle
    base.py            KVConnectorBase: the scheduler-side and worker-side hooks, the step's metadata
    layout.py          what the bytes mean (refuse another model's), the cache as rows of bytes
    store.py           a file store: one folder per transfer, one file per layer
    shared_storage.py  SharedStorageConnector: push, layer by layer through the file store
    shared_pool.py     SharedPoolConnector: pull, the consumer copies from the producer's own pool
                       (shared memory on a CPU, CUDA IPC on one GPU)
    cuda_ipc.py        CudaIpcConnector: pull over CUDA IPC only (two processes on one GPU), one-pass
                       run copies (kernels/kv_block_copy.py); refuses a CPU
"""

from .base import KVConnectorBase, KVConnectorMetadata, KVTransferError, KVTransferStats, ReqLoad, ReqSave
from .config import KVTransferConfig, check_kv_transfer_params, transfer_key
from .cuda_ipc import CudaIpcConnector
from .shared_pool import SharedPoolConnector
from .shared_storage import SharedStorageConnector

CONNECTORS = {"SharedStorageConnector": SharedStorageConnector, "SharedPoolConnector": SharedPoolConnector,
              "CudaIpcConnector": CudaIpcConnector}


def make_kv_connector(config: KVTransferConfig, block_size: int, specs) -> KVConnectorBase:
    """The connector config.kv_connector names (one per side: the scheduler's and the worker's)."""
    return CONNECTORS[config.kv_connector](config, block_size, specs)


__all__ = [
    "CONNECTORS",
    "CudaIpcConnector",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVTransferConfig",
    "KVTransferError",
    "KVTransferStats",
    "ReqLoad",
    "ReqSave",
    "SharedPoolConnector",
    "SharedStorageConnector",
    "check_kv_transfer_params",
    "make_kv_connector",
    "transfer_key",
]
