#!/usr/bin/env bash
# Chapter 10 on the GPU machine, run from the repository root with minillm installed. Parts:
#   bash scripts/gpu/ch10.sh tune       minillm bench moe --tune: fused-MoE tiles per M -> kernels/moe_configs/*.json
#   bash scripts/gpu/ch10.sh bench      minillm bench moe --quick: fused MoE vs loop vs dense, skew, MLA decode
#                                       (V2-Lite GB/s, V3 TFLOP/s vs 16 heads per program), same process
#   bash scripts/gpu/ch10.sh tests      the MoE/MLA kernel tests natively (Triton, CUDA graphs, real shapes)
#   bash scripts/gpu/ch10.sh e2e        throughput workload on DeepSeek-V2-Lite and Qwen3-30B-A3B dummy weights
#   bash scripts/gpu/ch10.sh notebook   notebooks/10_mla_moe.ipynb executed in place (its stored GPU outputs)
#   bash scripts/gpu/ch10.sh all        tune, then bench: one device call of about 4 minutes
# The tests need a call of their own on a fresh machine: compiling and autotuning the MLA kernel for
# fp32, fp16 and bf16 at every split bucket takes minutes (90 s were not enough on 2026-11-25).
# Logs and JSON land in $OUT (the tuned tables too: copy them into kernels/moe_configs/ to commit them).
set -uo pipefail
OUT=${OUT:-/tmp/ch10-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part() {
  case "$1" in
    tune)  # the installed package's table folder is where the bench below reads it
      timeout 135 python3 -m minillm bench moe --tune --tune-budget 80 2>&1 | tee "$OUT/ch10-tune.log"
      # the device copy drops file names with '=' and ',' (vLLM's naming): bring the tables back in one archive
      tar -C "$(python3 -c 'import minillm.kernels.fused_moe as m; print(m.CONFIG_DIR)')" -czf "$OUT/moe_configs.tgz" . ;;
    bench)
      timeout 130 python3 -m minillm bench moe --quick --json "$OUT/ch10-bench-moe.json" 2>&1 | grep -v "it/s\]" \
        | tee "$OUT/ch10-bench-moe.log" ;;
    tests)
      timeout 400 python3 -m pytest tests/test_kernels_mla.py tests/test_mla.py tests/test_kernels_moe.py \
        -k "not absorbed_equals_naive and not yarn" -q -p no:cacheprovider -rs --durations=8 2>&1 | tail -60 \
        | tee "$OUT/ch10-tests.log" ;;
    e2e)
      for m in deepseek-v2-lite qwen3-30b-a3b; do
        echo "=== throughput $m $(date +%T)"
        timeout 270 python3 -m minillm bench throughput --model $m-dummy --no-hf --json "$OUT/ch10-tp-$m.json" 2>&1 \
          | grep -v "it/s\]" | tail -14
      done 2>&1 | tee "$OUT/ch10-e2e.log" ;;
    notebook)
      timeout 580 python3 -m minillm.nbrun notebooks/10_mla_moe.ipynb 2>&1 | tail -30 | tee "$OUT/ch10-notebook.log"
      cp notebooks/10_mla_moe.ipynb "$OUT/" ;;
    *) echo "usage: $0 tune|bench|tests|e2e|notebook|all"; exit 2 ;;
  esac
}
if [ "${1:-all}" = all ]; then
  { date -u; echo "commit ${MINILLM_COMMIT:-unknown} (branch kernels)"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm \
      --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    2>&1 | tee "$OUT/ch10-run.txt"
  for p in tune bench; do echo "=== $p $(date +%T)"; part $p; done
else
  part "$1"
fi
