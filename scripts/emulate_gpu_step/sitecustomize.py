"""An emulated GPU step, for measuring the server's host-side costs on a CPU (chapter 12).

    PYTHONPATH=scripts/emulate_gpu_step MINILLM_EMULATE_STEP_US=500,3 \\
        python -m minillm.bench.serve_overhead --num-prompts 128 --input-len 128 512 --output-len 64 256

On a CPU the model's forward pass takes a few hundred milliseconds, so every request is in before
the second step and nothing the server does per token shows. An H100 steps the embedded model in a
few milliseconds. With MINILLM_EMULATE_STEP_US=BASE,PER_TOKEN set, every Python process that starts
with this folder on its path (the benchmark driver, the server, its spawned engine core, the
client) replaces ModelRunner.execute: the step is packed on the host as usual (the engine's
prepare, the worker's block-table changes), then the process sleeps BASE + PER_TOKEN x tokens microseconds (releasing the GIL, as a wait for the GPU does)
and returns random logits over the first 256 token ids. Greedy sampling then picks ordinary tokens,
which are appended, stop-checked and detokenized for real: everything but the forward pass is
minillm's own code. It is a sitecustomize (Python imports it at start-up) so that it reaches the
spawned engine-core process too, and so it works unchanged on an older checkout (a before/after).
Without the variable it does nothing.
"""

import os

_SPEC = os.environ.get("MINILLM_EMULATE_STEP_US")

if _SPEC:
    import time

    import torch

    _BASE_US, _PER_TOKEN_US = (float(x) for x in _SPEC.split(","))
    _GEN = torch.Generator().manual_seed(0)

    try:  # where the runner lives since the executor seam (chapter 13): the step arrives packed
        from minillm.worker.model_runner import ModelRunner

        def _emulated_execute(self, step, prev_tokens=None):
            self.step_block_table(step)  # the worker's host side of a step: its block-table changes
            time.sleep((_BASE_US + _PER_TOKEN_US * step.num_tokens) * 1e-6)
            return torch.randn(len(step.logits_indices), 256, generator=_GEN)  # [rows, 256]: greedy picks ids < 256
    except ImportError:  # an older checkout: the runner packs the step itself
        from minillm.engine.model_runner import ModelRunner

        def _emulated_execute(self, scheduled, block_tables, logits_indices):
            ids = self.prepare(scheduled, block_tables)[0]  # the host's packing, as a real step does it
            time.sleep((_BASE_US + _PER_TOKEN_US * len(ids)) * 1e-6)
            return torch.randn(len(logits_indices), 256, generator=_GEN)  # [rows, 256]: greedy picks ids < 256

    ModelRunner.execute = _emulated_execute
