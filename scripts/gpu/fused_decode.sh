#!/usr/bin/env bash
# Chapter 13's fused decode layer on the GPU machine. Run from the repo root after installing the wheels and
# minillm into $PYTHONPATH (RULES.md / .ci/gpu.sh); the embedded model is not needed (random and dummy-weight
# models only). Logs and JSON land in $OUT.
#   bash scripts/gpu/fused_decode.sh tests   the fused kernels' tests natively (real shapes, CUDA graphs) and the
#                                            fused step vs the PyTorch path (about 3 minutes on an H100)
#   bash scripts/gpu/fused_decode.sh bench   scripts/gpu/fused_decode.py: kernels per graphed decode layer, each
#                                            fusion vs its unfused kernels, graphed bs1 steps with fusions on/off
#   bash scripts/gpu/fused_decode.sh all     both (give the call its 600 s)
set -uo pipefail
OUT=${OUT:-/tmp/fused-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-all}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/fused-header.log"
if [ "$part" = tests ] || [ "$part" = all ]; then
  # the graph and end-to-end tests first: they are what the CPU cannot check
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -rfs --durations=8 \
    tests/test_fused_decode_layer.py "tests/test_kernels_attention.py::test_flash_decode_merge_in_a_cuda_graph_gpu" \
    tests/test_kernels_rope_store_kv.py tests/test_kernels_skinny_gemm.py tests/test_kernels_fused.py \
    "tests/test_kernels_attention.py::test_flash_decode_real_shapes_gpu" -s > "$OUT/fused-tests.log" 2>&1
  grep -v "^$" "$OUT/fused-tests.log" | tail -40
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  timeout "${BENCH_TIMEOUT:-280}" python3 scripts/gpu/fused_decode.py 2>&1 | tee "$OUT/fused-bench.log"
fi
