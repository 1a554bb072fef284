#!/usr/bin/env bash
# Chapter 13's fused decode layer on the GPU machine, in one call (about 4 minutes on an H100):
#   1. the fused kernels' tests natively (real shapes, CUDA graphs) and the fused step vs the PyTorch path;
#   2. scripts/gpu/fused_decode.py: kernels per graphed decode layer, each fusion vs its unfused kernels,
#      whole graphed batch-1 decode steps with the fusions on and off.
# Run from the repo root after installing the wheels and minillm into $PYTHONPATH (see RULES / .ci/gpu.sh).
# The embedded model is not needed (random and dummy-weight models only). Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fused-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; git log -1 --format=%h 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/fused-tests.log"
timeout "${TEST_TIMEOUT:-110}" python3 -m pytest -q -p no:cacheprovider -rfs --durations=8 \
  tests/test_kernels_rope_store_kv.py tests/test_kernels_skinny_gemm.py tests/test_kernels_fused.py \
  "tests/test_kernels_attention.py::test_flash_decode_real_shapes_gpu" \
  "tests/test_kernels_attention.py::test_flash_decode_merge_in_a_cuda_graph_gpu" tests/test_fused_decode_layer.py -s 2>&1 \
  | grep -v "^$" | tail -60 | tee -a "$OUT/fused-tests.log"
timeout "${BENCH_TIMEOUT:-150}" python3 scripts/gpu/fused_decode.py 2>&1 | tee "$OUT/fused-bench.log"
