#!/usr/bin/env bash
# Chapter 17 (disaggregated prefill and decode) on the one-GPU machine. Run from the repo root with minillm on
# $PYTHONPATH (.ci/gpu.sh); no model file needed (random and dummy-weight models). Logs and JSON land in $OUT.
#   bash scripts/gpu/ch17.sh tests     the KV-transfer tests natively: CUDA IPC across two processes (both pool
#                                      connectors), the oracles, the CUDA IPC connector's unit tests     ~60 s
#   bash scripts/gpu/ch17.sh bw        scripts/gpu/kv_transfer_bw.py per connector: transfer GB/s vs a plain copy of
#                                      the same bytes in the same run, 3 repeats min/median/max       ~3 x 40 s
#   bash scripts/gpu/ch17.sh bench     minillm bench disagg --json (Qwen3-0.6B-shaped dummy, bf16; colocated vs
#                                      1 prefill + 1 decode process, 7 rates, the prefill burst)         ~150 s
#   bash scripts/gpu/ch17.sh notebook  notebooks/17_disaggregation.ipynb executed in place (needs the notebook
#                                      wheels: nbclient, ipykernel, matplotlib), copied to $OUT          ~120 s
#   bash scripts/gpu/ch17.sh all       tests, bw, bench (the notebook separately: it needs its wheels)
set -uo pipefail
OUT=${OUT:-/tmp/ch17-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-all}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/ch17-header.log"
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -rfs --durations=8 \
    tests/test_kv_transfer.py tests/test_kv_cuda_ipc.py > "$OUT/ch17-tests.log" 2>&1
  tail -30 "$OUT/ch17-tests.log"
fi
if [ "$part" = bw ] || [ "$part" = all ]; then
  for c in CudaIpcConnector SharedPoolConnector SharedStorageConnector; do
    CONNECTOR=$c timeout "${BENCH_TIMEOUT:-250}" python3 scripts/gpu/kv_transfer_bw.py | tee -a "$OUT/ch17-bw.jsonl"
  done
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  MINILLM_BENCH_JSON="$OUT/ch17-disagg.json" timeout "${DISAGG_TIMEOUT:-400}" python3 -m minillm bench disagg \
    > "$OUT/ch17-disagg.txt" 2>&1
  tail -25 "$OUT/ch17-disagg.txt"
fi
if [ "$part" = notebook ]; then
  MINILLM_BENCH_JSON="$OUT/ch17-notebook-bench.json" timeout "${NB_TIMEOUT:-300}" python3 -m minillm.nbrun \
    notebooks/17_disaggregation.ipynb 2>&1 | grep -v IPKernelApp | tail -20
  cp notebooks/17_disaggregation.ipynb "$OUT/"
fi
