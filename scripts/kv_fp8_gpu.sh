#!/usr/bin/env bash
# Chapter 08 part B on the GPU machine, after `.ci/gpu.sh setup DIR` (and `model DIR` for the embedded
# model): the quantized-KV and FP8 tests natively, then the measurements, each part one JSON under $OUT.
#
#   OUT=... scripts/kv_fp8_gpu.sh tests        # ~3 min: kernel + engine tests for KV fp8/int8, FP8 W8A8
#   OUT=... scripts/kv_fp8_gpu.sh bench        # ~5 min: decode attention, FP8 GEMM sweep, KV pool capacity
#   OUT=... scripts/kv_fp8_gpu.sh throughput   # ~6 min: `minillm bench throughput` (Qwen3-0.6B dummy), bf16 vs fp8 KV
#   OUT=... scripts/kv_fp8_gpu.sh agreement    # ~3-5 min: the embedded model, greedy agreement, bf16/fp32 KV vs fp8/int8 KV
set -uo pipefail
OUT=${OUT:-/tmp/kvfp8-out}; mkdir -p "$OUT"
case "${1:-}" in
  tests)
    .ci/gpu.sh pytest "$OUT" tests/test_kv_quant.py tests/test_fp8.py tests/test_kernels_attention.py \
      tests/test_kernels_store_kv.py tests/test_engine.py
    ;;
  bench)
    for part in decode gemm capacity; do
      echo "=== $part $(date +%T)"
      timeout 190 .ci/gpu.sh exec python3 scripts/kv_fp8_gpu.py $part "$OUT" 2>&1 | tee "$OUT/$part.log"
    done
    ;;
  throughput)
    for kv in auto fp8; do
      echo "=== throughput kv_cache_dtype=$kv $(date +%T)"
      timeout 280 .ci/gpu.sh exec python3 -m minillm bench throughput --model qwen3-0.6b-dummy --no-hf \
        --kv-cache-dtype $kv --json "$OUT/throughput-qwen3-0.6b-kv-$kv.json" 2>&1 | grep -v "it/s\]" | tail -14 \
        | tee "$OUT/throughput-kv-$kv.log"
    done
    ;;
  agreement)
    timeout 560 .ci/gpu.sh exec python3 scripts/kv_fp8_gpu.py agreement "$OUT" 2>&1 | tee "$OUT/agreement.log"
    ;;
  *) echo "usage: OUT=DIR $0 tests|bench|throughput|agreement" >&2; exit 2 ;;
esac
