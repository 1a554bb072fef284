"""Chapter 18's decode backends: "pdl" (the projections of decode steps through kernels/gemv.py) gives the
greedy tokens of "graphs" (the layers' own path), and is refused clearly where it cannot run.

What a CPU proves: the GEMV path's wiring (which weights, norms and residuals go where, the residual
stream carried as one tensor, padded graph rows) computes the layer, through the engine, under Triton's
interpreter, in the graph path's padded buffers run eagerly. What only a GPU proves: the PDL launches
(the interpreter has no griddepcontrol: `gdc_wait` placement is a GPU question), the split-K counters
under real concurrency, and the graph capture; scripts/gpu/floor_gemv.py checks tokens there too.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from tiny_models import random_model

import minillm.kernels.gemv as gemv_kernels
from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.layers.backend import kernel_mode
from minillm.layers.decode_gemv import decode_gemv_refusal, enable_decode_gemv
from minillm.worker.model_runner import ModelRunner


def _greedy(model, tok, requests, backend: str, calls: list) -> list[list[int]]:
    with kernel_mode("triton"):
        engine = LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4,
                                                        max_num_batched_tokens=32, decode_backend=backend))
        engine.runner.graphs = engine.runner.make_graphs(capture=False)  # the graphs' padded buffers, eagerly
        before = len(calls)
        for i, (p, sp) in enumerate(requests):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        used = len(calls) - before
    assert (used > 0) == (backend == "pdl"), f"{backend}: {used} GEMV launches"
    return [done[str(i)] for i in range(len(requests))]


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# padding rows of the decode graphs hold garbage (worker/cuda_graphs.py) that the interpreter's numpy may overflow on
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.skipif(not INTERPRETED, reason="a CPU model under the interpreter (the GPU's check: floor_gemv.py)")
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pdl_backend_gives_the_tokens_of_graphs(seed, tok, arch, monkeypatch):
    rng = random.Random(seed)
    model, config = random_model(rng, architecture=arch, qk_norm=arch == "qwen3", sliding_windows=[])
    calls = []
    launch = gemv_kernels.gemv
    monkeypatch.setattr(gemv_kernels, "gemv", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    requests = [([rng.randrange(config.vocab_size) for _ in range(rng.randrange(3, 12))],
                 SamplingParams(max_tokens=rng.randrange(3, 7), temperature=0.0)) for _ in range(3)]
    graphs = _greedy(model, tok, requests, "graphs", calls)
    pdl = _greedy(model, tok, requests, "pdl", calls)
    assert pdl == graphs
    enable_decode_gemv(model, None)


def test_refusals(monkeypatch):
    """A CPU without the interpreter's Triton path, a model without the dense layer, a bad name. The CPU
    is accepted only in the interpreter's test mode (kernel mode "triton" and TRITON_INTERPRET=1), which
    the function reads from the environment at the call: set both ways here, so that the test says the
    same on a CPU machine (the suite runs with TRITON_INTERPRET=1) and on a GPU one (it runs without)."""
    model, _ = random_model(random.Random(0), architecture="llama", sliding_windows=[])
    assert "CUDA GPU" in decode_gemv_refusal(model, torch.device("cpu"))  # kernel mode "auto": references
    with kernel_mode("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert decode_gemv_refusal(model, torch.device("cpu")) is None
        monkeypatch.delenv("TRITON_INTERPRET")
        assert "CUDA GPU" in decode_gemv_refusal(model, torch.device("cpu"))
    assert "no GEMV decode path" in decode_gemv_refusal(torch.nn.Linear(2, 2), torch.device("cpu"))
    with pytest.raises(ValueError, match="decode_backend must be one of"):
        EngineConfig(decode_backend="megakernel")
    with pytest.raises(ValueError, match="decode GEMV mode"):
        enable_decode_gemv(model, "fast")


def test_enabling_marks_the_layers_and_their_attention():
    model, _ = random_model(random.Random(2), architecture="qwen3", qk_norm=True, sliding_windows=[])
    layers, attns = model.model.layers, [layer.self_attn.attn for layer in model.model.layers]
    enable_decode_gemv(model, "pdl")
    assert all(layer.decode_gemv == "pdl" for layer in layers) and all(a.pdl for a in attns)
    enable_decode_gemv(model, None)
    assert all(layer.decode_gemv is None for layer in layers) and not any(a.pdl for a in attns)


def test_the_runner_refuses_pdl_with_a_reason(tok):
    model, _ = random_model(random.Random(1), architecture="llama", sliding_windows=[])
    with pytest.raises(ValueError, match="decode_backend='pdl' is not supported here: it needs a CUDA GPU"):
        LLMEngine(model, tok, [], EngineConfig(block_size=4, num_gpu_blocks=16, decode_backend="pdl"))
    assert ModelRunner  # the runner is where the check lives (worker/model_runner.py _enable_pdl)
