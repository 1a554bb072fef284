"""One tensor-parallel rank other than 0: a process that holds a shard and runs what rank 0 sends (chapter 11).

With tensor parallelism the engine's process is rank 0: it schedules, samples and owns a Worker of
its own. Every other rank is a process started by `python -m minillm.worker.worker_proc` (or by
`torchrun`), which

    joins the group                  init_distributed_environment(world_size, rank, init_method)
    builds and loads its shard       the layers ask the group which slice is theirs (chapter 11)
    wraps it in a Worker             its own KV cache (its KV heads), its own CUDA graphs
    serves rank 0                    run_worker_loop: receive a call, run it, repeat until "shutdown"

A call is plain data broadcast from rank 0 through the group's CPU channel: (method name, arguments),
e.g. ("execute_model", (ModelInput, number of tokens sampled last step)). The forward pass's
all-reduces then meet rank 0's inside the same kernels order on every rank; rank 0 alone gets the
logits (the head's slices are gathered there) and samples.

The process is started with a fresh interpreter and reads its arguments (pickled) from stdin, so it
never re-imports the user's script the way multiprocessing's spawn does.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback

import torch

from ..distributed import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_tp_group,
    init_distributed_environment,
)
from .worker import Worker


def build_model(model_fn: str, kwargs: dict):
    """Call "module:function"(**kwargs) and take the model from what it returns: load_model's (model,
    config, tokenizer), the serving benchmarks' ServingModels (.model), or the model itself."""
    module, _, name = model_fn.partition(":")
    out = getattr(importlib.import_module(module), name)(**kwargs)
    if isinstance(out, tuple):
        return out[0]
    return getattr(out, "model", out)


def rank_device(device_type: str, group: GroupCoordinator) -> torch.device:
    """NCCL: this rank's own GPU (the group chose it); gloo: the CPU."""
    return group.device if group.backend == "nccl" else torch.device(device_type)


def run_worker_loop(worker: Worker, group: GroupCoordinator) -> None:
    """Run rank 0's calls on this rank's worker until it sends "shutdown". Each call here mirrors the
    one rank 0 makes on its own worker (executor/multiproc_executor.py), so the collectives inside
    them meet in the same order on every rank."""
    while True:
        method, args = group.broadcast_object(None, src=0)
        if method == "shutdown":
            worker.shutdown()
            return
        if method == "execute_model":
            step, num_prev = args
            prev = None
            if num_prev:  # overlap scheduling: the tokens rank 0 sampled last step, still on its GPU
                prev = group.broadcast(torch.empty(num_prev, dtype=torch.long, device=group.device))  # [num_prev]
            worker.execute_model(step, prev, sample=False)  # rank 0 samples
        elif method == "determine_num_blocks":
            group.all_reduce_min(list(worker.determine_num_blocks()))
        elif method == "initialize_cache":
            worker.initialize_cache(*args, progress=False)
        elif method in ("swap_and_copy", "capture_token_buckets"):
            getattr(worker, method)(*args)
        else:
            raise ValueError(f"rank {group.rank}: unknown call {method!r} from rank 0")


def serve_rank(rank: int, world_size: int, model_fn: str, model_kwargs: dict, config, device_type: str) -> None:
    """Build this rank's shard and Worker in a group that is already initialized, then serve rank 0."""
    group = get_tp_group()
    group.warm_up()  # NCCL's communicators exist before any CUDA graph is captured
    model = build_model(model_fn, {**model_kwargs, "device": rank_device(device_type, group)})
    worker = Worker(model, config)
    run_worker_loop(worker, group)


def main() -> int:
    args = pickle.load(sys.stdin.buffer)
    rank, world_size = args["rank"], args["world_size"]
    if args["device_type"] == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_distributed_environment(world_size, rank, args["init_method"], backend=args["backend"],
                                     timeout_s=args["timeout_s"])
        serve_rank(rank, world_size, args["model_fn"], args["model_kwargs"], args["config"], args["device_type"])
    except BaseException:
        # rank 0 sees this process exit (MultiprocExecutor checks its workers before each call)
        print(f"minillm tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        os._exit(1)
    destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    sys.exit(main())
