"""MultiprocExecutor: one Worker per tensor-parallel rank, each in its own process (chapter 11; vLLM's name).

The engine's process is rank 0. `start_tensor_parallel` starts ranks 1..N-1 (`python -m
minillm.worker.worker_proc`, one GPU each under NCCL, CPU processes under gloo), joins them in one
group, and each process builds and loads only its shard. Then every executor call is

    rank 0:  broadcast (method, plain-data arguments)  ->  run it on its own Worker  ->  result
    rank r:  receive it                                ->  run it on its own Worker  (worker_proc.py)

so the all-reduces inside the forward pass meet in the same order on every rank. Two calls need more
than the message: determine_num_blocks takes the minimum over the ranks (each rank's pool holds its
own KV heads, and the engine's block numbers must be valid on all of them), and execute_model sends
the tokens rank 0 sampled last step (overlap scheduling keeps them on rank 0's GPU) by a device
broadcast. Only rank 0 receives logits and samples; it returns the tokens.

A worker that dies is seen before the next call (its process has exited) or inside a collective
(gloo reports the closed connection; NCCL times out): the call raises a RuntimeError naming the
rank, and every later call raises it again: the group cannot recover a lost shard.

Under `torchrun --nproc-per-node N` the processes exist already: every rank runs the same script,
rank 0 returns from start_tensor_parallel as the engine's rank, and the others serve it from inside
that call and exit when it shuts down (gpt-fast's way of starting ranks).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import weakref

import torch

from ..distributed import (
    destroy_distributed_environment,
    get_distributed_init_method,
    get_open_port,
    get_tp_group,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from ..layers.quantization import get_quantization_config
from ..spec_decode import make_proposer
from ..worker.model_input import ModelInput, ModelRunnerOutput
from ..worker.worker import Worker
from ..worker.worker_proc import serve_rank
from .abstract import Executor


def _under_torchrun(world_size: int) -> bool:
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == world_size > 1


def check_tp_size(tensor_parallel_size, device: torch.device) -> int:
    """tensor_parallel_size: a positive int; on CUDA, one GPU per rank, from GPU 0."""
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, not {tensor_parallel_size!r}")
    if tensor_parallel_size > 1 and device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} uses GPUs 0..{tensor_parallel_size - 1}; "
                         f"device={device} cannot be rank 0 (use device='cuda' and CUDA_VISIBLE_DEVICES)")
    return tensor_parallel_size


def check_tp_engine(config) -> None:
    """What tensor parallelism does not run (yet): refused before any process starts."""
    if config is None:
        raise ValueError("tensor_parallel_size > 1 needs the engine (enable_kv_cache=True)")
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":
        raise ValueError(f"speculative decoding with tensor_parallel_size > 1 drafts only with method 'ngram' "
                         f"(no forward passes: rank 0 looks the drafts up alone), not {spec.method!r}; a "
                         f"model's draft passes would need every rank")
    if config.kv_cache_dtype not in (None, "auto"):
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} with tensor_parallel_size > 1 is not "
                         f"supported: its scales are calibrated by forward passes on rank 0 alone")


def check_tp_quantization(quantization) -> None:
    """Weights quantized in a way that needs the whole layer: refused at tensor_parallel_size > 1."""
    config = get_quantization_config(quantization)
    name = getattr(config, "name", None)
    if name in ("awq", "gptq") and getattr(config, "path", None) is None:
        raise ValueError(f"quantization={name!r} calibrates each whole layer on text as it loads; at "
                         f"tensor_parallel_size > 1 a rank would calibrate only its shard (not supported): run "
                         f"`minillm quantize --method {name}` once and load the folder it writes (every rank "
                         f"takes its part of the saved tensors)")


def start_tensor_parallel(world_size: int, model_fn: str, model_kwargs: dict, config, device_type: str,
                          backend: str | None = None, timeout_s: float = 300.0) -> list[subprocess.Popen]:
    """Make this process rank 0 of a group of world_size and start the other ranks, each of which
    builds its shard with model_fn ("module:function", called with model_kwargs and its own device)
    and a Worker on `config`. -> the worker processes (none under torchrun). Call it before loading
    rank 0's own shard: the layers read the group when they are built."""
    if model_parallel_is_initialized():
        raise RuntimeError("a tensor-parallel group is already running in this process (shut its engine "
                           "down first)")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} on CUDA needs {world_size} GPUs (one per rank); "
                         f"{torch.cuda.device_count()} visible")
    if _under_torchrun(world_size):
        group = init_distributed_environment(backend=backend, timeout_s=timeout_s)
        if group.rank != 0:  # serve rank 0 from here, then leave: the script's later lines are rank 0's
            serve_rank(group.rank, world_size, model_fn, model_kwargs, config, device_type)
            destroy_distributed_environment()
            raise SystemExit(0)
        group.warm_up()
        return []
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    # the children find minillm where this process found it, whatever the working directory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = []
    for rank in range(1, world_size):
        p = subprocess.Popen([sys.executable, "-c", "from minillm.worker.worker_proc import main; main()"], stdin=subprocess.PIPE, env=env)
        p.stdin.write(pickle.dumps(dict(rank=rank, world_size=world_size, init_method=init_method, backend=backend,
                                        model_fn=model_fn, model_kwargs=model_kwargs, config=config,
                                        device_type=device_type, timeout_s=timeout_s)))
        p.stdin.close()
        procs.append(p)
    try:
        group = init_distributed_environment(world_size, 0, init_method, backend=backend, timeout_s=timeout_s)
        group.warm_up()
    except BaseException:
        stop_workers(procs)
        raise
    return procs


def stop_workers(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """Wait for the workers to leave (after "shutdown"), killing any that do not, and leave the group."""
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    destroy_distributed_environment()


class _Ranks:
    """What stopping the other ranks needs, apart from the executor: a weakref.finalize holds this, not
    the executor, so an executor that is garbage-collected (`del llm`) still stops its ranks and leaves
    the group, and the next engine in this process can start its own (of any size)."""

    def __init__(self, procs: list[subprocess.Popen], group):
        self.procs, self.group = procs, group
        self.failed: BaseException | None = None

    def dead(self) -> str | None:
        dead = [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
        return ", ".join(f"rank {r} exited with code {c}" for r, c in dead) or None

    def stop(self) -> None:
        """Tell every rank to let its memory go and exit; wait for them; leave the group. Runs once
        (weakref.finalize): at shutdown(), when the executor is collected, or at interpreter exit."""
        if not model_parallel_is_initialized() or get_tp_group() is not self.group:
            return  # left already (a torchrun script's own teardown)
        if self.failed is None and self.dead() is None:
            try:
                self.group.broadcast_object(("shutdown", ()), src=0)
            except Exception:  # a rank died meanwhile: the kill below ends the others
                self.failed = RuntimeError("a rank left during shutdown")
        if self.failed is not None:
            for p in self.procs:
                p.kill()
        stop_workers(self.procs)


class MultiprocExecutor(Executor):
    def __init__(self, procs: list[subprocess.Popen], model, config):
        check_tp_engine(config)
        self.procs, self.config, self.group = procs, config, get_tp_group()
        self.ranks = _Ranks(procs, self.group)
        self.worker = Worker(model, config)
        self.sizes = self.worker.sizes
        # not atexit.register(self.shutdown): that would keep the executor alive until exit
        self._stop = weakref.finalize(self, self.ranks.stop)

    @property
    def failed(self) -> BaseException | None:
        return self.ranks.failed

    @failed.setter
    def failed(self, e: BaseException | None) -> None:
        self.ranks.failed = e

    def _dead(self) -> str | None:
        return self.ranks.dead()

    def _call(self, method: str, *args, local=None):
        """Send (method, args) to every rank, then run `local` (or the same method) on rank 0's worker."""
        if self.failed is not None:
            raise RuntimeError(f"the tensor-parallel group failed earlier ({self.failed}); start a new engine")
        if not self._stop.alive:
            raise RuntimeError("this engine was shut down; start a new one")
        try:
            if (dead := self._dead()) is not None:
                raise RuntimeError(f"a tensor-parallel worker died: {dead}")
            self.group.broadcast_object((method, args), src=0)
            return local() if local is not None else getattr(self.worker, method)(*args)
        except Exception as e:  # the ranks may be out of step now: no later call can be trusted
            dead = self._dead()
            if dead is None or "worker died" in str(e):
                self.failed = e
                raise
            self.failed = RuntimeError(f"a tensor-parallel call failed ({e}): {dead}")
            raise self.failed from e

    def determine_num_blocks(self) -> tuple[int, int]:
        return tuple(self._call("determine_num_blocks", local=lambda: self.group.all_reduce_min(
            list(self.worker.determine_num_blocks()))))

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, progress: bool = True) -> None:
        self._call("initialize_cache", num_gpu_blocks, num_cpu_blocks,
                   local=lambda: self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks, progress))
        self.sizes = self.worker.sizes
        if self.config.speculative_config is not None:  # n-gram lookups (check_tp_engine): rank 0's alone
            self.worker.attach_proposer(make_proposer(self.config.speculative_config, None, None, self.sizes))

    def execute_model(self, model_input: ModelInput) -> ModelRunnerOutput:
        prev_tokens = self.worker.last_sampled  # rank 0 sampled them: the other ranks get a copy
        if model_input.prev_token_dst and prev_tokens is None:  # checked before any rank starts the step
            raise ValueError("this step takes tokens sampled by the previous one, but none were given")
        num_prev = prev_tokens.numel() if model_input.prev_token_dst else 0

        def run() -> ModelRunnerOutput:
            if num_prev:  # [num_prev] to every rank, in order with the step (the same device stream)
                self.group.broadcast(prev_tokens.to(torch.long).contiguous())
            return self.worker.execute_model(model_input)

        return self._call("execute_model", model_input, num_prev, local=run)

    def sample_tokens(self, bitmask) -> ModelRunnerOutput:
        """Rank 0 alone samples (the other ranks ran the step with sample=False): nothing to send."""
        return self.worker.sample_tokens(bitmask)

    def swap_and_copy(self, swap_out, swap_in, copies, offload_save=(), offload_load=()) -> None:
        # every rank moves its own shard of the same blocks (chapter 15's offload tier too)
        self._call("swap_and_copy", swap_out, swap_in, copies, offload_save, offload_load)

    def propose(self, seqs, num_spec, table_changes):
        """Chapter 09's n-gram drafts, on rank 0 alone: a lookup in the tokens, no forward pass. The other
        ranks get the drafts' table changes with the verify step's message."""
        return self.worker.propose(seqs, num_spec, table_changes)

    def capture_token_buckets(self) -> None:
        self._call("capture_token_buckets", self.sizes.max_model_len)

    def shutdown(self) -> None:
        """Let rank 0's memory go, then stop the other ranks and leave the group (once)."""
        if self._stop.alive:
            self.worker.shutdown()
        self._stop()
