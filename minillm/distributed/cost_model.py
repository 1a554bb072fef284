r"""What an all-reduce costs, in the alpha-beta model, and what tensor parallelism buys a decode step.

A message of n bytes between two ranks takes alpha + n / beta: alpha the fixed cost (a launch, a
handshake, the link's latency), beta the bandwidth. A ring all-reduce over p ranks cuts the message
into p chunks and makes 2(p - 1) steps (p - 1 to reduce-scatter, p - 1 to all-gather), each moving
one chunk of n / p bytes:

    T_ring(n, p) = 2 (p - 1) alpha + 2 (p - 1) / p * n / beta

A one-shot all-reduce (each rank reads the other p - 1 buffers and sums them itself) makes one step
that moves (p - 1) n bytes into each rank: alpha + (p - 1) n / beta. It wins for the small messages
of a decode step, where alpha dominates. Both are linear in (alpha, 1 / beta), so measured times over
a sweep of sizes fit them by least squares (`fit_alpha_beta`).

A decode step of a dense model at tensor-parallel size p reads 1/p of the weights on each rank and
adds two all-reduces per layer of the [batch, hidden] activation (after o_proj and after down_proj):

    T_step(p) = W / (p * B_mem) + 2 L T_allreduce(batch * hidden * bytes, p)
"""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("ring", "one_shot")


def _terms(nbytes: float, world_size: int, algorithm: str) -> tuple[float, float]:
    """(the multiple of alpha, the bytes over beta) of one all-reduce."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    if world_size < 1 or nbytes < 0:
        raise ValueError(f"world_size must be >= 1 and nbytes >= 0, got {world_size} and {nbytes}")
    p = world_size
    if p == 1:
        return 0.0, 0.0  # nothing to exchange
    if algorithm == "ring":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes
    return 1.0, (p - 1) * nbytes


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per step
    beta: float  # bytes per second
    algorithm: str = "ring"

    def allreduce_time(self, nbytes: float, world_size: int) -> float:
        """Seconds for one all-reduce of nbytes over world_size ranks."""
        a, b = _terms(nbytes, world_size, self.algorithm)
        return a * self.alpha + b / self.beta


def fit_alpha_beta(sizes: list[float], times: list[float], world_size: int, algorithm: str = "ring") -> AlphaBeta:
    """Least-squares (alpha, beta) from all-reduce times (seconds) measured at message sizes (bytes).
    Relative errors are weighted equally (each row divided by its time), so the small messages, where
    alpha lives, count as much as the large ones."""
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError("fit_alpha_beta needs times at two or more distinct sizes (one time per size)")
    if world_size < 2:
        raise ValueError(f"an all-reduce over {world_size} rank(s) moves nothing: nothing to fit")
    if min(times) <= 0:
        raise ValueError("all-reduce times must be positive")
    # normal equations of  min sum_i ((a_i alpha + b_i g - t_i) / t_i)^2,  g = 1 / beta
    s_aa = s_ab = s_bb = s_at = s_bt = 0.0
    for n, t in zip(sizes, times):
        a, b = _terms(n, world_size, algorithm)
        a, b = a / t, b / t
        s_aa, s_ab, s_bb, s_at, s_bt = s_aa + a * a, s_ab + a * b, s_bb + b * b, s_at + a, s_bt + b
    det = s_aa * s_bb - s_ab * s_ab
    alpha = (s_at * s_bb - s_bt * s_ab) / det
    g = (s_aa * s_bt - s_ab * s_at) / det
    if alpha < 0 or g <= 0:
        raise ValueError(f"the times do not fit alpha + n / beta with alpha >= 0, beta > 0 (got alpha {alpha:.3g} s, "
                         f"1/beta {g:.3g} s/B): sizes too few or times too noisy")
    return AlphaBeta(alpha, 1.0 / g, algorithm)


def tp_decode_step_time(weight_bytes: float, mem_bandwidth: float, world_size: int, num_layers: int,
                        hidden_size: int, batch: int, act_bytes: int, comm: AlphaBeta,
                        allreduces_per_layer: int = 2) -> float:
    """Predicted seconds of one memory-bound decode step at tensor-parallel size world_size: each rank
    streams 1/p of the weights, then the layers' all-reduces of [batch, hidden] activations."""
    weights = weight_bytes / world_size / mem_bandwidth
    message = batch * hidden_size * act_bytes
    return weights + allreduces_per_layer * num_layers * comm.allreduce_time(message, world_size)
