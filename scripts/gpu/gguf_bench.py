# ruff: noqa: B023, E402, E702  (benchmark closures are timed at once, inside their loop)
"""Chapter 08, GGUF-native on the GPU: is quantization="gguf" worth being the default for a quantized
.gguf file? The embedded SmolLM2 (Q4_1 + Q8_0 embedding) dequantized to bf16 vs kept packed:
weight memory, batch-1 decode (latency workload: 128-token prompt, 256 new tokens) and a throughput
workload, alternating A B A B in one process; then its GEMMs alone (CUDA-graph timing)."""
import json
import os
import random
import statistics
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from minillm import LLM, SamplingParams
from minillm.layers.quantization.utils import parameter_bytes

out = os.environ.get("OUT", "/tmp")
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
print(res, flush=True)
rng = random.Random(0)


def latency(llm, runs=4):
    tps = []
    for i in range(runs + 1):
        prompt = [rng.randrange(1000, 40000) for _ in range(128)]
        sp = SamplingParams(temperature=0, max_tokens=256, min_tokens=256, ignore_eos=True)
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        t = o.metrics.token_times[0]
        if i:
            tps.append((len(t) - 1) / (t[-1] - t[0]))
    return statistics.median(tps)


def throughput(llm, n=128):
    reqs = [([rng.randrange(1000, 40000) for _ in range(rng.randint(100, 512))], rng.randint(100, 512))
            for _ in range(n)]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    sps = [SamplingParams(temperature=0, max_tokens=m, min_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate(prompts[:8], sps[:8], use_tqdm=False)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(m for _, m in reqs) / (time.perf_counter() - t0)


llms = {}
for q in (None, "gguf"):
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(device="cuda", dtype="bfloat16", quantization=q, num_gpu_blocks=8192)
    name = q or "bf16 (dequantized at load)"
    llms[name] = llm
    res[f"{name} param_MB"] = parameter_bytes(llm.model)["total"] / 1e6
    print(name, "params MB", res[f"{name} param_MB"], flush=True)
rows = {k: {"latency": [], "throughput": []} for k in llms}
for rep in range(2):
    for name, llm in llms.items():
        rows[name]["latency"].append(latency(llm))
        rows[name]["throughput"].append(throughput(llm))
        print(rep, name, rows[name]["latency"][-1], rows[name]["throughput"][-1], flush=True)
res["e2e"] = rows
names = list(llms)
res["latency_ratio_gguf_over_bf16"] = statistics.median(rows[names[1]]["latency"]) / statistics.median(rows[names[0]]["latency"])
res["throughput_ratio_gguf_over_bf16"] = statistics.median(rows[names[1]]["throughput"]) / statistics.median(rows[names[0]]["throughput"])
print("gguf/bf16 batch-1 decode tok/s:", res["latency_ratio_gguf_over_bf16"], " throughput:",
      res["throughput_ratio_gguf_over_bf16"], flush=True)

# the GEMMs alone: SmolLM2's qkv / gate_up / down shapes in the file's formats vs bf16 cuBLAS
from minillm.kernels.w4a16 import w4a16_gemm, w8a16_gemm

packed = llms["gguf"].model
layer = packed.model.layers[0]
gemms = {"qkv": layer.self_attn.qkv_proj, "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj,
         "lm_head(Q8_0)": packed.lm_head}
dense = llms[names[0]].model
dl = dense.model.layers[0]
dense_w = {"qkv": dl.self_attn.qkv_proj.weight, "gate_up": dl.mlp.gate_up_proj.weight, "down": dl.mlp.down_proj.weight,
           "lm_head(Q8_0)": dense.lm_head.weight}
res["gemm"] = []
for name, mod in gemms.items():
    w = dense_w[name]
    for M in (1, 16, 128, 1024):
        x = torch.randn(M, w.shape[1], device="cuda", dtype=torch.bfloat16)
        t_bf16 = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=30)
        if mod.qweight.dtype == torch.uint8:
            f = lambda: w4a16_gemm(x, mod.qweight, mod.scales, mod.mins, 32)
        else:
            f = lambda: w8a16_gemm(x, mod.qweight, mod.scales, 32)
        t_q = do_bench_cudagraph(f, rep=30)
        row = {"layer": name, "N": w.shape[0], "K": w.shape[1], "M": M, "bf16_us": t_bf16 * 1e3, "gguf_us": t_q * 1e3,
               "speedup": t_bf16 / t_q}
        res["gemm"].append(row)
        print(json.dumps(row), flush=True)
json.dump(res, open(f"{out}/gguf_bench.json", "w"), indent=1)
