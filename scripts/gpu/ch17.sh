#!/usr/bin/env bash
# Chapter 17 (disaggregated prefill and decode) on the one-GPU machine. Run from the repo root with minillm on
# $PYTHONPATH (.ci/gpu.sh); no model file needed (random and dummy-weight models). Logs and JSON land in $OUT.
#   bash scripts/gpu/ch17.sh tests   the KV-transfer tests natively: CUDA IPC across two processes, the oracles
#   bash scripts/gpu/ch17.sh bw      scripts/gpu/kv_transfer_bw.py: CUDA IPC transfer GB/s vs the copy GB/s
#   bash scripts/gpu/ch17.sh all     both
set -uo pipefail
OUT=${OUT:-/tmp/ch17-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-all}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/ch17-header.log"
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -rfs --durations=8 \
    tests/test_kv_transfer.py > "$OUT/ch17-tests.log" 2>&1
  tail -30 "$OUT/ch17-tests.log"
fi
if [ "$part" = bw ] || [ "$part" = all ]; then
  for c in SharedPoolConnector SharedStorageConnector; do
    CONNECTOR=$c timeout "${BENCH_TIMEOUT:-250}" python3 scripts/gpu/kv_transfer_bw.py | tee -a "$OUT/ch17-bw.jsonl"
  done
fi
