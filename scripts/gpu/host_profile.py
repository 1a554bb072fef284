"""Where a batch-256 decode step's host time goes (chapter 13): cProfile over steady-state steps (overlap on and off),
plus a torch.profiler chrome trace of 5 steps (overlap on).  python scripts/gpu/host_profile.py OUT_DIR (minillm installed)."""
import cProfile
import io
import os
import pstats
import random
import sys
import time

import torch

from minillm.bench.serving import _engine, _engine_config
from minillm.bench.serving_setup import free_engine, load_models
from minillm.bench.step_profile import _timed_steps
from minillm.sampling import SamplingParams

out = sys.argv[1]
dev = torch.device(os.environ.get("DEV", "cuda"))  # DEV=cpu B=4: a quick check off the GPU
B = int(os.environ.get("B", "256"))
# STREAMING=1: step() returns every running request's output each step (what the e516dd1 logs in
# chapters/bench/h200-2026-11-26/ measured); the default steps as LLM.generate does
STREAMING = os.environ.get("STREAMING") == "1"
models = load_models("smollm2-135m-dummy", dev)
for on in (True, False):
    engine = _engine(models, _engine_config({"max_num_seqs": B, "async_scheduling": on}), False)
    rng = random.Random(0)
    ids = [f"r{i}" for i in range(B)]
    p = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(engine.model.config.vocab_size) for _ in range(32)]}, p)
    seqs = [engine.groups[r].seqs[0] for r in ids]
    while not all(s.output_ids for s in seqs):
        engine.step(unfinished_outputs=STREAMING)
    _timed_steps(engine, 10, STREAMING)
    walls = _timed_steps(engine, 30, STREAMING)
    print(f"overlap={on} median wall {1e3*sorted(walls)[15]:.3f} ms", flush=True)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(50):
        engine.step(unfinished_outputs=STREAMING)
    pr.disable()
    dt = time.perf_counter() - t0
    print(f"overlap={on} cProfile'd: {1e3*dt/50:.3f} ms/step", flush=True)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
        txt = s.getvalue()
        print(txt[:9000])
        open(f"{out}/other256-{'on' if on else 'off'}-{key}.txt", "w").write(txt)
    if on and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
            for _ in range(5):
                engine.step(unfinished_outputs=STREAMING)
            torch.cuda.synchronize()
        prof.export_chrome_trace(f"{out}/trace-bs256-on.json")
        os.system(f"gzip -f {out}/trace-bs256-on.json")
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    free_engine(engine)
