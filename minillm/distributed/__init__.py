"""Tensor parallelism's plumbing (chapter 11): the group of ranks, its collectives, and the sizes
that split. The layers (layers/linear.py, layers/vocab_parallel_embedding.py) ask only the rank,
the world size and the collectives; with one rank those are 0, 1 and the identity.

    parallel_state.py    GroupCoordinator, init/destroy, get_tp_group, simulate_tensor_parallel
    communication_op.py  tensor_model_parallel_all_reduce / all_gather / gather, broadcast
    utils.py             divide, the sizes a model splits at, a free port for spawned ranks
    launch.py            run_ranks: spawn a group of ranks from one process, run a function, get results
    measure.py           all-reduce times on a spawned group, eager and in a CUDA graph (for the alpha-beta fit)
    greedy.py            greedy decoding across the ranks (rank 0 samples and broadcasts)
    cost_model.py        the alpha-beta cost of an all-reduce, and a fit to measured times
    kv_transfer/         chapter 17: KV connectors that move a prompt's K/V from a prefill engine to a decode one
"""

from .communication_op import (
    broadcast,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from .launch import run_ranks
from .parallel_state import (
    GroupCoordinator,
    SimulatedGroup,
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    model_parallel_is_initialized,
    simulate_tensor_parallel,
)
from .utils import (
    check_tensor_parallel_size,
    divide,
    get_distributed_init_method,
    get_open_port,
    tensor_parallel_sizes,
)

__all__ = [
    "GroupCoordinator", "SimulatedGroup", "broadcast", "check_tensor_parallel_size", "destroy_distributed_environment",
    "divide", "get_distributed_init_method", "get_open_port", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "get_tp_group", "init_distributed_environment",
    "model_parallel_is_initialized", "run_ranks", "simulate_tensor_parallel", "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce", "tensor_model_parallel_gather", "tensor_parallel_sizes",
]
