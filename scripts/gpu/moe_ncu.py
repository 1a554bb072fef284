"""Fused MoE for Nsight Compute: Qwen3-30B-A3B's experts (E = 128, top-8, hidden 2048, expert width
768, bf16) at M tokens, uniform random routing, the per-GPU tile table's pick; then a dense GEMM of the
same FLOPs (cuBLAS) to read the two side by side (chapter 10: the 45 %-of-dense target).
    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section ComputeWorkloadAnalysis --section WarpStateStats python3 scripts/gpu/moe_ncu.py --tokens 4096
"""
import argparse

import torch

from minillm.kernels.fused_moe import fused_experts, get_config

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--top-k", type=int, default=8)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--width", type=int, default=768)
args = ap.parse_args()
T, E, K, H, I = args.tokens, args.experts, args.top_k, args.hidden, args.width
dev, dt = torch.device("cuda"), torch.bfloat16
x = torch.randn(T, H, device=dev, dtype=dt)
w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02  # [E, 2I, H]
w2 = torch.randn(E, H, I, device=dev, dtype=dt) * 0.02  # [E, H, I]
scores = torch.randn(T, E, device=dev).softmax(-1)
weights, ids = scores.topk(K, dim=-1)  # [T, K] each
print("tile:", get_config(T, E, I, K, dt, dev))
a = torch.randn(T * K, H, device=dev, dtype=dt)  # the dense GEMM of gate_up's FLOPs: [T*K, H] @ [H, 2I]
b = torch.randn(H, 2 * I, device=dev, dtype=dt)
for _ in range(3):
    fused_experts(x, w13, w2, weights, ids)
    a @ b
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()  # ncu --profile-from-start off: only these launches, after compiling
fused_experts(x, w13, w2, weights, ids)
a @ b
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
