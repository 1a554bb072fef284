#!/usr/bin/env bash
# Chapter 18 on one H200 (run from the repository root, minillm importable; no network):
#   bash scripts/gpu/ch18.sh tests     the GEMV, the decode backends and lab 18's checks natively        ~90 s
#   bash scripts/gpu/ch18.sh notebook  notebooks/18_decode_floor.ipynb executed in place (needs the notebook
#                                      wheels: nbclient, ipykernel, matplotlib), copied to $OUT, its JSON
#                                      in $OUT/ch18-notebook.json                                      ~150 s
#   bash scripts/gpu/ch18.sh lab       notebooks/labs/18_decode_floor.ipynb executed (a copy), to $OUT   ~40 s
# The GEMV sweep and the e2e ladder with more models: scripts/gpu/floor_gemv.py (OUT=... , ~4 min).
set -uo pipefail
OUT=${OUT:-/tmp/ch18-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-tests}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/ch18-header.log"
if [ "$part" = tests ]; then
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -rfs --durations=8 \
    tests/test_kernels_gemv.py tests/test_decode_backend.py tests/test_lab18_checks.py > "$OUT/ch18-tests.log" 2>&1
  tail -30 "$OUT/ch18-tests.log"
fi
if [ "$part" = notebook ]; then
  MINILLM_BENCH_JSON="$OUT/ch18-notebook.json" timeout "${NB_TIMEOUT:-300}" python3 -m minillm.nbrun \
    notebooks/18_decode_floor.ipynb 2>&1 | grep -v IPKernelApp | tail -20
  cp notebooks/18_decode_floor.ipynb "$OUT/"
fi
if [ "$part" = lab ]; then
  cp notebooks/labs/18_decode_floor.ipynb "$OUT/lab18.ipynb"
  timeout "${NB_TIMEOUT:-200}" python3 -m minillm.nbrun "$OUT/lab18.ipynb" 2>&1 | grep -v IPKernelApp | tail -20
fi
