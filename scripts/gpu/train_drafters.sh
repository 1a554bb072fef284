#!/usr/bin/env bash
# Chapter 09, part two (issue 46): train Medusa heads and an EAGLE layer for the embedded model, then
# `bench spec` with their rows. Run from the repo root with minillm on $PYTHONPATH (.ci/gpu.sh setup, the
# embedded model installed). Logs and JSON land in $OUT; the drafters in $OUT/drafters (they travel back).
#   bash scripts/gpu/train_drafters.sh train      both drafters (~3-5 min on an H200: generation ~1 min,
#                                                 each training ~1-2 min)
#   bash scripts/gpu/train_drafters.sh bench      bench spec: plain, ngram, medusa, eagle; k 2 4; batch 1 8 64;
#                                                 3 alternating repeats (~5-7 min); needs `train` first (same
#                                                 machine, or DRAFTERS=<folder with medusa/ and eagle/>)
#   bash scripts/gpu/train_drafters.sh adaptive   the same configurations with adaptive k (~4-6 min)
#   bash scripts/gpu/train_drafters.sh tests      the learned-drafter oracles natively (~2 min)
# Each part stays under the 10-minute command limit; `all` runs train then bench (~10-12 min: two calls
# are safer).
set -uo pipefail
OUT=${OUT:-/tmp/drafters-out}; mkdir -p "$OUT"
DRAFTERS=${DRAFTERS:-$OUT/drafters}
export PYTHONUNBUFFERED=1
part=${1:-all}
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/drafters-header.log"
if [ "$part" = train ] || [ "$part" = all ]; then
  for m in medusa eagle; do
    timeout "${TRAIN_TIMEOUT:-280}" python3 -m minillm train-drafter --method "$m" --steps "${STEPS:-600}" \
      --samples "${SAMPLES:-8}" --max-tokens 256 --out "$DRAFTERS/$m" --json "$OUT/train-$m.json" \
      2>&1 | tee "$OUT/train-$m.log"
  done
fi
if [ "$part" = bench ] || [ "$part" = all ] || [ "$part" = adaptive ]; then
  extra=(); tag=spec
  if [ "$part" = adaptive ]; then extra=(--adaptive); tag=spec-adaptive; fi
  timeout "${BENCH_TIMEOUT:-540}" python3 -m minillm bench spec --k 2 4 --draft-layers --batch-sizes 1 8 64 \
    --medusa "$DRAFTERS/medusa" --eagle "$DRAFTERS/eagle" --repeats "${REPEATS:-3}" "${extra[@]}" \
    --json "$OUT/$tag.json" 2>&1 | tee "$OUT/$tag.log"
fi
if [ "$part" = tests ]; then
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -rfs --durations=8 \
    tests/test_spec_learned.py tests/test_train_drafter.py > "$OUT/drafters-tests.log" 2>&1
  tail -30 "$OUT/drafters-tests.log"
fi
