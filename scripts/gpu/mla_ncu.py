"""MLA decode, DeepSeek-V3 shapes (128 heads, latent 512 + rope 64), batch 32, context 4096, bf16: the kernel
ncu profiles (its launches after two warm-ups), with the default head block and with 16 heads a program."""
import torch

from minillm.bench.moe import _mla_inputs
from minillm.kernels.mla_decode import mla_decode

q, cache, lens, seq_idx, table = _mla_inputs(32, 4096, 128, (512, 64), torch.device("cuda"), torch.bfloat16)
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
