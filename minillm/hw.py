"""The machine's ceilings, measured: how fast it moves bytes and how fast it multiplies.

Every kernel in this course is judged against two numbers of the device it runs on:

  copy bandwidth  B  (bytes/s): a large device-to-device copy, counting bytes read plus written
  matmul rate     P  (FLOP/s):  a large dense matrix product in the dtype the model runs in

An operation that does F FLOPs and must move at least M bytes cannot finish faster than
max(F / P, M / B). Its arithmetic intensity I = F / M decides which term wins: below the ridge
I* = P / B it is memory-bound (decode), above it compute-bound (prefill). That is the roofline.

Datasheet numbers are leads, not ceilings; we measure. Later chapters call `ceilings()` (measured
once per process and device) to print "% of roofline" next to every benchmark.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_gbps: float  # GB/s (1e9 bytes), read + write
    matmul_tflops: float  # TFLOP/s (1e12 FLOP) for `dtype`
    dtype: str

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two roofs meet."""
        return self.matmul_tflops * 1e12 / (self.copy_gbps * 1e9)

    def attainable_tflops(self, intensity: float) -> float:
        """The roofline: the best TFLOP/s an op of this intensity (FLOP/byte) can reach."""
        return min(self.matmul_tflops, intensity * self.copy_gbps / 1e3)

    def floor_seconds(self, flops: float, nbytes: float) -> float:
        """The fastest an op that does `flops` and moves `nbytes` can run here."""
        return max(flops / (self.matmul_tflops * 1e12), nbytes / (self.copy_gbps * 1e9))

    def as_dict(self) -> dict:
        return {**asdict(self), "ridge_flop_per_byte": self.ridge}


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def matmul_cost(m: int, n: int, k: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """(FLOPs, minimum bytes) of C[m, n] = A[m, k] @ B[k, n].

    Each output element is a k-long dot product: k multiplies + k adds = 2k FLOPs. The fewest bytes
    are reading A and B once and writing C once.
    """
    flops = 2 * m * n * k
    nbytes = (m * k + k * n + m * n) * dtype_bytes
    return flops, nbytes


def time_it(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20, inner: int | None = None,
            device: torch.device | None = None, cuda_graph: bool = False) -> float:
    """Median seconds per call of fn(), warm-up excluded.

    Each of `reps` samples times `inner` calls issued back to back, so the GPU never waits for the
    CPU between them: with one call per sample, the host's launch time (several microseconds) would
    land inside the measurement of a kernel that itself takes tens. `inner` defaults to enough calls
    to fill about a millisecond. CUDA: device events; CPU: the wall clock.

    cuda_graph=True (CUDA only) records the `inner` calls once into a CUDA graph and times replays of
    it: the GPU then runs the kernels with no host in the loop at all, which is what a small kernel
    costs inside an engine that replays graphs (chapter 07). Without it, a kernel shorter than its
    own launch (tens of µs of Python on a slow host) measures the host, not the kernel.
    """
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def run_n(n: int) -> None:
        if not (cuda and cuda_graph):
            for _ in range(n):
                fn()
            return
        if n not in graphs:  # recorded once, outside any timed region
            graphs[n] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[n]):
                for _ in range(n):
                    fn()
        graphs[n].replay()

    def sample(n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if cuda_graph and n not in graphs:
                run_n(n)  # records the graph (and runs it once) before the clock starts
            start.record()
            run_n(n)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    if inner is None:
        once = sample(1)
        inner = max(1, min(1000, int(1e-3 / max(once, 1e-7)))) if cuda else 1
    return statistics.median(sample(inner) for _ in range(reps))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def measure_copy_gbps(device: torch.device, nbytes: int) -> float:
    """A device-to-device copy of `nbytes`: (read + write) bytes / median seconds."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_it(lambda: dst.copy_(src), device=device)
    return 2 * nbytes / seconds / 1e9


def measure_matmul_tflops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """A square n x n x n product on random data (never zeros: they run faster than real data)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_it(lambda: a @ b, device=device, reps=10 if device.type == "cpu" else 30)
    return matmul_cost(n, n, n)[0] / seconds / 1e12


def ceilings_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware has matrix units for it; fp32 on a CPU (bf16 GEMM there is emulated)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@cache
def _ceilings(device_str: str) -> Ceilings:
    device = torch.device(device_str)
    big = device.type == "cuda"
    dtype = ceilings_dtype(device)
    return Ceilings(
        device=device_name(device),
        copy_gbps=measure_copy_gbps(device, (1 << 30) if big else (64 << 20)),
        matmul_tflops=measure_matmul_tflops(device, 8192 if big else 1024, dtype),
        dtype=str(dtype).removeprefix("torch."),
    )


def ceilings(device: torch.device | str | None = None) -> Ceilings:
    """This device's measured ceilings (measured on first call, then cached for the process)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _ceilings(str(device))


def gemm_sweep(device: torch.device, n: int, k: int, batch_sizes: list[int], dtype: torch.dtype) -> list[dict]:
    """Time a linear layer, X[b, k] @ W[n, k]^T, for each batch size b: the same weights, more rows.

    b = 1 is a GEMV, what a decode step does per request; a prefill of b tokens is a GEMM. The
    weights dominate the bytes until b is in the hundreds, so time barely moves while FLOPs grow.
    W is stored [out, in] as in nn.Linear, the layout the model's layers use.
    """
    w = torch.randn(n, k, device=device, dtype=dtype)
    rows = []
    for b in batch_sizes:
        x = torch.randn(b, k, device=device, dtype=dtype)
        seconds = time_it(lambda x=x: torch.nn.functional.linear(x, w), device=device,
                          reps=30 if device.type == "cuda" else 5)
        flops, nbytes = matmul_cost(b, n, k, dtype_bytes(dtype))
        rows.append({
            "batch": b, "seconds": seconds, "tflops": flops / seconds / 1e12,
            "gbps": nbytes / seconds / 1e9, "intensity": flops / nbytes,
        })
    return rows
