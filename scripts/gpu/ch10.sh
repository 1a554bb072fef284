#!/usr/bin/env bash
# Chapter 10 on the GPU machine, after `.ci/gpu.sh setup .gpu`. One part per call (each under 10 minutes):
#   bash .gpu/ch10.sh tests      the MoE/MLA tests natively (Triton kernels, CUDA graphs, real shapes)
#   bash .gpu/ch10.sh bench      minillm bench moe: fused MoE vs loop vs dense, routing skew, MLA decode GB/s
#   bash .gpu/ch10.sh e2e        throughput workload on DeepSeek-V2-Lite and Qwen3-30B-A3B dummy weights
#   bash .gpu/ch10.sh notebook   notebooks/10_mla_moe.ipynb executed in place (its stored GPU outputs)
# Logs and JSON land in $OUT; the notebook is copied there too.
set -uo pipefail
OUT=${OUT:-/tmp/ch10-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    timeout 560 python3 -m pytest tests/test_kernels_moe.py tests/test_mla.py tests/test_moe.py tests/test_models_moe.py \
      -q -p no:cacheprovider -rs --durations=10 2>&1 | tail -40 | tee "$OUT/ch10-tests.log" ;;
  bench)
    timeout 560 python3 -m minillm bench moe --json "$OUT/ch10-bench-moe.json" 2>&1 | grep -v "it/s\]" \
      | tee "$OUT/ch10-bench-moe.log" ;;
  e2e)
    for m in deepseek-v2-lite qwen3-30b-a3b; do
      echo "=== throughput $m $(date +%T)"
      timeout 270 python3 -m minillm bench throughput --model $m-dummy --no-hf --json "$OUT/ch10-tp-$m.json" 2>&1 \
        | grep -v "it/s\]" | tail -14
    done 2>&1 | tee "$OUT/ch10-e2e.log" ;;
  notebook)
    timeout 580 python3 -m minillm.nbrun notebooks/10_mla_moe.ipynb 2>&1 | tail -30 | tee "$OUT/ch10-notebook.log"
    cp notebooks/10_mla_moe.ipynb "$OUT/" ;;
  *) echo "usage: $0 tests|bench|e2e|notebook"; exit 2 ;;
esac
