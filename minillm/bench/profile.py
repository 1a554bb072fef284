"""Benchmark: where a decode step's time goes, per batch size, with overlap scheduling on and off (chapter 13).

    minillm bench profile --model qwen3-0.6b-dummy --batch-sizes 1,64,256 --json profile.json

For each batch size and each setting of `async_scheduling`, one engine steps that many requests in
steady-state decode (`step_profile.profile_decode_step`) and the table shows the step's wall time, the
GPU's kernel time and busy share, kernels per step and per layer, and the host's phases. The top
kernels of each run are printed below it. On a CPU only the host's phases mean anything.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from ..hw import default_device
from .serving import _engine, _engine_config, _write
from .serving_setup import free_engine, header, load_models
from .step_profile import profile_decode_step
from .table import print_table

COLS = ["async", "batch_size", "wall_ms", "gpu_kernel_ms", "gpu_busy_pct", "gap_ms", "kernels_per_step",
        "kernels_per_layer", "schedule_ms", "prepare_ms", "launch_ms", "sample_ms", "other_ms"]


def run(model=None, *, batch_sizes: str | list[int] = "1,64,256", steps: int = 10, overlap: str = "both",
        prompt_len: int = 32, streaming: bool = False, device=None, json_path=None, progress: bool = True, **engine_args) -> dict:
    device = default_device() if device is None else torch.device(device)
    sizes = [int(b) for b in batch_sizes.split(",")] if isinstance(batch_sizes, str) else list(batch_sizes)
    for b in sizes:
        check_int("batch_sizes", b)
    check_int("steps", steps)
    check_int("prompt_len", prompt_len)
    settings = {"both": [True, False], "on": [True], "off": [False]}.get(overlap)
    if settings is None:
        raise ValueError(f"overlap must be 'both', 'on' or 'off', not {overlap!r}")
    models = load_models(model, device)
    info = header(f"profile: one decode step at batch sizes {sizes}, overlap scheduling {overlap}, "
                  f"{'every request' if streaming else 'finished requests'} returned each step; "
                  f"{models.label}, {models.dtype_name}")
    rows, runs = [], []
    for on in settings:
        args = {"max_num_seqs": max(sizes), **engine_args, "async_scheduling": on}
        engine = _engine(models, _engine_config(args), progress)
        for b in sizes:
            prof = profile_decode_step(engine, b, steps=steps, prompt_len=prompt_len, streaming=streaming)
            runs.append(prof)
            rows.append({"async": "on" if on else "off", **{k: prof[k] for k in COLS[1:]}})
            for k in prof["top_kernels"]:
                k["batch_size"], k["async"] = b, rows[-1]["async"]
        free_engine(engine)
    print_table(rows, COLS, title="one decode step (medians over steps)")
    tops = [k for p in runs for k in p["top_kernels"]]
    if tops:
        print_table(tops, ["async", "batch_size", "name", "launches_per_step", "us_per_step"], title="top kernels")
    ops = [{"async": "on" if p["async_scheduling"] else "off", "batch_size": p["batch_size"], **o}
           for p in runs for o in p["top_host_ops"]]
    if ops:
        print_table(ops, ["async", "batch_size", "name", "calls_per_step", "host_us_per_step"],
                    title="top host-side operations (own CPU time)")
    return _write({**info, "workload": "profile", "model": models.label, "device": str(device), "runs": runs},
                  json_path)


def add_arguments(parser, workload: str) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file, HF folder, or PRESET-dummy (default: the "
                        "embedded SmolLM2-135M)")
    parser.add_argument("--batch-sizes", default="1,64,256", help="comma-separated (default 1,64,256)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per batch size")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of each request's prompt: the context "
                        "(and block-table width) the decode steps run at (default 32)")
    parser.add_argument("--overlap", default="both", choices=["both", "on", "off"],
                        help="overlap scheduling (async_scheduling) settings to run")
    parser.add_argument("--streaming", action="store_true", help="step() as a streaming caller "
                        "takes it: every running request's output each step (default: the finished ones, as "
                        "LLM.generate and the engine core take it)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
