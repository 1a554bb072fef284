"""Lab 12, exercise 5: an open-loop arrival process, checked by statistics and against minillm's own.

`minillm bench serve --request-rate λ --burstiness k` sends request i at the sum of i gaps drawn from
Gamma(shape k, scale 1/(kλ)) (serve_metrics.arrival_times): mean 1/λ, variance 1/(kλ²); k = 1 is a
Poisson process (exponential gaps). A generator is random, so the check cannot compare numbers; it
tests what the process must be, on a long run per (λ, k) with a fixed seed:

- the rate: the mean of n gaps has standard deviation 1/(λ√(kn)) (central limit theorem), so a
  correct generator has |mean·λ - 1|·√(kn) <= 5 except with probability 6e-7;
- the distribution of the gaps (Kolmogorov-Smirnov): by the Dvoretzky-Kiefer-Wolfowitz inequality
  (Massart's constant) the empirical CDF of n draws is farther than ε from the true one with
  probability at most 2·exp(-2nε²); ε is set so that this is 1e-6;
- independence: the gaps' lag-1 correlation is about N(0, 1/n) for independent gaps; bound 5/√n;
- minillm's generator: both empirical CDFs within ε of the same Gamma CDF means within 2ε of each
  other (the triangle inequality), a two-sample test with a bound that holds at any n.

Each bound fails a correct generator with probability about 1e-6 whatever the seed (seed-robust), and
the seed is fixed so that a run is reproducible; tests/test_lab12_checks.py runs minillm's generator
through the check over many seeds and the classic slips through it once.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..bench.serve_metrics import arrival_times as reference_arrival_times
from .checker import PASSED, CheckFailed, Verdict

NUM = 20_000  # arrivals per process: 5σ of the rate is ±3.5 % at k = 1
Z = 5.0  # standard deviations allowed for the rate and the lag-1 correlation
P_KS = 1e-6  # the DKW bound's false-alarm probability
PROCESSES = ((7.3, 1.0, 11), (0.4, 1.0, 12), (2.0, 0.5, 13), (25.0, 4.0, 14))  # (rate λ, burstiness k, seed)


def dkw_epsilon(n: int, p: float = P_KS) -> float:
    """ε with P(sup |F_n - F| > ε) <= 2·exp(-2nε²) = p."""
    return math.sqrt(math.log(2 / p) / (2 * n))


def ks_gamma(gaps: np.ndarray, rate: float, burstiness: float) -> float:
    """sup |F_n - F| of the gaps against Gamma(shape k, scale 1/(kλ))."""
    x = np.sort(gaps)
    n = len(x)
    k = torch.tensor(burstiness, dtype=torch.float64)
    cdf = torch.special.gammainc(k, torch.from_numpy(x * burstiness * rate)).numpy()  # regularized P(k, x/scale)
    i = np.arange(1, n + 1)
    return float(max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n)))


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> float:
    """sup |F_a - F_b| of two samples' empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    z = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, z, "right") / len(a) - np.searchsorted(b, z, "right") / len(b))))


def lag1(gaps: np.ndarray) -> float:
    g = gaps - gaps.mean()
    return float(np.dot(g[:-1], g[1:]) / np.dot(g, g))


def _fail(message: str):
    raise CheckFailed(f"❌ arrival_times: {message}")


def _times(fn, num, rate, burstiness, seed) -> list[float]:
    out = fn(num, rate, burstiness, seed)
    times = [float(t) for t in out]
    call = f"arrival_times({num}, {rate}, {burstiness}, seed={seed})"
    if len(times) != num:
        _fail(f"{call} returned {len(times)} times, not {num}")
    if num and times[0] != 0.0:
        _fail(f"{call}: the first request goes at 0 (times are seconds after it), got {times[0]!r}")
    if any(not (b >= a) for a, b in zip(times, times[1:])) or not all(map(math.isfinite, times)):
        _fail(f"{call}: times must be finite and non-decreasing (a sum of gaps), got {times[:6]}...")
    return times


def _contract(fn) -> None:
    """Bad input refused, rate inf all at once, a seed reproducible."""
    for rate, k in [(0.0, 1.0), (-2.0, 1.0), (math.nan, 1.0), (3.0, 0.0), (3.0, -1.0), (3.0, math.inf),
                    (3.0, math.nan)]:
        try:
            fn(10, rate, k, 0)
        except ValueError:
            continue
        except Exception as e:
            _fail(f"arrival_times(10, rate={rate}, burstiness={k}) raised {type(e).__name__}: {e}; a bad rate or "
                  "burstiness should raise ValueError naming it (rate > 0, inf allowed; 0 < burstiness < inf)")
        _fail(f"arrival_times(10, rate={rate}, burstiness={k}) did not raise ValueError")
    if _times(fn, 5, math.inf, 1.0, 0) != [0.0] * 5:
        _fail("rate inf sends every request at once: all times 0.0")
    if _times(fn, 0, 3.0, 1.0, 0) != [] or _times(fn, 1, 3.0, 1.0, 0) != [0.0]:
        _fail("0 requests -> [], 1 request -> [0.0]")
    if _times(fn, 50, 3.0, 1.0, 5) != _times(fn, 50, 3.0, 1.0, 5):
        _fail("the same seed must give the same times (a benchmark run must be reproducible)")
    if _times(fn, 50, 3.0, 1.0, 5) == _times(fn, 50, 3.0, 1.0, 6):
        _fail("seeds 5 and 6 gave the same times: draw from a generator seeded with `seed`")


def check_arrival_times(fn, processes=PROCESSES, num: int = NUM) -> Verdict:
    """fn(num, rate, burstiness, seed) -> send times in seconds after the first (a list of num floats)."""
    if not callable(fn):
        raise TypeError(f"arrival_times: pass your function itself, not {type(fn).__name__}")
    _contract(fn)
    n = num - 1  # gaps
    eps = dkw_epsilon(n)
    for rate, k, seed in processes:
        gaps = np.diff(np.asarray(_times(fn, num, rate, k, seed)))
        ref = np.diff(np.asarray(reference_arrival_times(num, rate, k, seed + 1000)))
        z = (gaps.mean() * rate - 1) * math.sqrt(k * n)
        d, r1, d2 = ks_gamma(gaps, rate, k), lag1(gaps), ks_two_sample(gaps, ref)
        print(f"   λ {rate:>4}/s, k {k}: rate {1 / gaps.mean():.4g}/s (z {z:+.2f}, |z| <= {Z:g}) · KS vs Gamma "
              f"{d:.4f} <= {eps:.4f} · lag-1 corr {r1:+.4f} (<= {Z / math.sqrt(n):.4f}) · vs minillm {d2:.4f} "
              f"<= {2 * eps:.4f}")
        where = f"λ = {rate}, burstiness {k}, seed {seed}, {num} arrivals"
        if not abs(z) <= Z:
            _fail(f"{where}: mean gap {gaps.mean():.6g} s, expected 1/λ = {1 / rate:.6g} s ± {Z:g}σ "
                  f"(σ = 1/(λ√(kn)) = {1 / (rate * math.sqrt(k * n)):.3g} s)")
        if not d <= eps:
            _fail(f"{where}: the gaps' CDF is {d:.4f} from Gamma(shape {k}, scale 1/(kλ)), more than the DKW "
                  f"bound {eps:.4f}")
        if not abs(r1) <= Z / math.sqrt(n):
            _fail(f"{where}: consecutive gaps are correlated ({r1:+.4f}); they must be independent draws")
        if not d2 <= 2 * eps:
            _fail(f"{where}: the gaps' CDF is {d2:.4f} from minillm's, more than {2 * eps:.4f}")
    print(f"✅ arrival_times: {len(processes)} processes of {num:,} arrivals have the rate, gap distribution and "
          "independence of minillm's")
    return Verdict("arrival_times", PASSED, len(processes))
