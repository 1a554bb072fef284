"""MLA decode for Nsight Compute (latent 512 + rope 64, bf16): the kernel's launches after warm-ups, with
the default head block and with 16 heads a program. Defaults: DeepSeek-V3 shapes (128 heads), batch 32,
context 4096; `--heads 16` is DeepSeek-V2-Lite's.
    ncu --profile-from-start off --launch-count 6 --section SpeedOfLight ... python3 scripts/gpu/mla_ncu.py --heads 16
"""
import argparse

import torch

from minillm.bench.moe import _mla_inputs
from minillm.kernels.mla_decode import mla_decode

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--heads", type=int, default=128)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--context", type=int, default=4096)
args = ap.parse_args()
q, cache, lens, seq_idx, table = _mla_inputs(args.batch, args.context, args.heads, (512, 64), torch.device("cuda"),
                                             torch.bfloat16)
for _ in range(3):
    mla_decode(q, cache, lens, seq_idx, table, 512, 0.1)
for _ in range(2):
    mla_decode(q, cache, lens, seq_idx, table, 512, 0.1, head_block=16)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()  # ncu --profile-from-start off: only these launches, after autotuning
mla_decode(q, cache, lens, seq_idx, table, 512, 0.1)
mla_decode(q, cache, lens, seq_idx, table, 512, 0.1, head_block=16)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
