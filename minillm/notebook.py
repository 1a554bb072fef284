"""Helpers every chapter notebook uses: the header line, device-sized problems, standard plots.

A notebook runs unchanged on a CPU-only machine (small shapes, Triton under TRITON_INTERPRET=1) and
on a CUDA GPU (real shapes, real benchmarks):

    from minillm import notebook as nb
    nb.header("00")                               # names the GPU (or CPU), versions, date, commit, modules hash
    n = nb.pick(cpu=256, gpu=8192)                # sizes follow the device
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import __version__


def device() -> torch.device:
    """The GPU if there is one, else the CPU (the same choice as minillm.hw.default_device)."""
    from .hw import default_device

    return default_device()


def on_gpu() -> bool:
    return device().type == "cuda"


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pick(cpu, gpu):
    """The problem size for this device: `gpu` on a CUDA GPU, else the small `cpu` one."""
    return gpu if on_gpu() else cpu


def describe_device(dev: torch.device | None = None) -> str:
    dev = dev or device()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return (f"GPU {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                f"{p.total_memory / (1 << 30):.0f} GiB), CUDA {torch.version.cuda}")
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def git_commit(where: Path | None = None) -> str:
    """$MINILLM_COMMIT when set (a copied tree on a GPU machine, whose .git, if any, may be another
    commit's), else the short commit of the checkout this runs from (the package's, else the working
    directory's), or "unknown"."""
    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    for cwd in (where, Path(__file__).resolve().parent, Path.cwd()):
        if cwd is None:
            continue
        try:
            out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


def provenance(chapter: str) -> str:
    """"commit C · modules H": the commit and the hash of the chapter's own module files (minillm.course),
    which `minillm labs stale` compares with today's files."""
    from .course import chapter as course_chapter
    from .course import modules_hash

    return f"commit {git_commit()} · modules {modules_hash(course_chapter(chapter))}"


def header_line(chapter: str = "") -> str:
    """The line that says where a notebook's numbers come from: device, versions, date, and for a
    chapter the commit and the hash of its module files."""
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "absent"
    parts = [
        f"minillm {__version__}" + (f" · chapter {chapter}" if chapter else ""),
        describe_device(),
        f"torch {torch.__version__}",
        f"triton {triton_v}" + (" (interpreter)" if interpreted() else ""),
        f"Python {platform.python_version()}",
        _dt.date.today().isoformat(),
    ]
    if chapter:
        parts.append(provenance(chapter))
    return " | ".join(parts)


def header(chapter: str = "") -> None:
    """Print the header line; every notebook's first output."""
    print(header_line(chapter))


# ---- plots ---------------------------------------------------------------------------------------


def _axes(ax=None, figsize=(7, 4)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, dpi=100)
    return ax


def plot_lines(x: Sequence, series: dict[str, Sequence], *, xlabel: str, ylabel: str, title: str = "",
               logx: bool = False, logy: bool = False, ax=None, marker: str = "o"):
    """One line per series over the same x: the standard 'metric vs size' plot."""
    ax = _axes(ax)
    for label, ys in series.items():
        ax.plot(x, ys, marker=marker, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return ax


def plot_bars(labels: Sequence[str], values: Sequence[float], *, ylabel: str, title: str = "", ax=None,
              annotate: str = "{:.3g}"):
    """Side-by-side bars, e.g. minillm vs its peer, each annotated with its value."""
    ax = _axes(ax, figsize=(6, 3.5))
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    for bar, v in zip(bars, values):
        ax.annotate(annotate.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set(ylabel=ylabel, title=title)
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def plot_roofline(ceilings, points: Sequence[tuple[str, float, float]] = (), *, title: str = "", ax=None,
                  intensity_range: tuple[float, float] | None = None):
    """The roofline of `ceilings` (a minillm.hw.Ceilings) with measured (label, FLOP/byte, TFLOP/s) points."""
    import numpy as np

    ax = _axes(ax, figsize=(7, 4.5))
    lo, hi = intensity_range or (0.25, max(4 * ceilings.ridge, 1e3))
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(xs, [ceilings.attainable_tflops(x) for x in xs], "k-", lw=2, label="roofline (measured ceilings)")
    ax.axvline(ceilings.ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ceilings.ridge:.0f} FLOP/B", (ceilings.ridge, ceilings.matmul_tflops * 0.5),
                rotation=90, ha="right", va="center", color="gray")
    for i, (label, intensity, tflops) in enumerate(points):
        ax.plot(intensity, tflops, "o", color=f"C{i % 10}", ms=7, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="TFLOP/s",
           title=title or f"Roofline: {ceilings.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return ax


def widget(fn: Callable, **controls):
    """An ipywidgets control panel for fn(**controls). Cells that call it are tagged `widget`: the
    site hides them and shows the static plot drawn just before from the same function."""
    try:
        import ipywidgets
    except ImportError:
        print("ipywidgets is not installed: `pip install ipywidgets` to turn the knobs here")
        return None
    return ipywidgets.interact(fn, **controls)


def tiny_random_model(seed: int = 0, max_len: int = 4096, dev: torch.device | None = None):
    """A 2-layer Llama with SmolLM2's vocabulary and random weights, large enough that the logits
    have clear winners (as tests/tiny_models.py makes them): the CPU stand-in for the real model
    in the engine notebooks. -> (model, config)."""
    from .config import ModelConfig
    from .loader import load_model

    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=max_len, name="tiny-random")
    m, _, _ = load_model(cfg, load_format="dummy", dtype=torch.float32, device=dev or device())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            norm = "norm" in name
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
    return m, cfg


def warm_up(models, tokenizer, max_prompt_len: int) -> None:
    """Tune and compile each model's prefill kernel for every prompt-length bucket up to max_prompt_len
    (LLMEngine.warm_up) on a throwaway one-sequence engine, before a notebook times anything. Tuning is
    kept per process, so the notebook's later engines over the same models find it done."""
    from .engine import EngineConfig, LLMEngine

    for m in dict.fromkeys(models):  # (a CPU notebook may pass the same stand-in twice)
        config = EngineConfig(max_num_batched_tokens=max_prompt_len, num_gpu_blocks=2 + -(-max_prompt_len // 16),
                              max_num_seqs=1, cuda_graph_max_batch=1)
        engine = LLMEngine(m, tokenizer, [], config, progress=False)
        print(f"warm-up of {m.config.name} ({next(m.parameters()).dtype}): {engine.warm_up():.1f} s")
        engine.shutdown()
