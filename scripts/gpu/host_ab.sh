#!/usr/bin/env bash
# Chapter 13's host changes on the GPU, before vs after in one call (one GPU, dummy weights, no model file):
#   the throughput workload for Qwen3-0.6B and SmolLM2-135M with the tree at .wt/before (BEFORE=<commit>)
#   and with this tree, interleaved per model so a cut-short call still returns pairs. `python3 -P`: without it
#   `-m minillm` imports the package in the working directory (this tree) on both sides.
# Carry [".wt/before", ".gpu/min"]. Logs and JSON land in $OUT as one archive, host_ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/host-ab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for side in before after; do
  src=$([ $side = before ] && echo .wt/before || echo .)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-$side .gpu/min/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site-$side "$src"
done
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
  echo "before ${BEFORE:-unknown} after ${AFTER:-unknown}"; } | tee "$OUT/host-ab.log"
for m in ${MODELS:-qwen3-0.6b smollm2-135m}; do
  for side in before after; do
    PYTHONPATH=/tmp/site-$side MINILLM_COMMIT=$([ $side = before ] && echo "${BEFORE:-}" || echo "${AFTER:-}") \
      timeout ${RUN_S:-70} python3 -P -m minillm bench throughput --model "$m-dummy" --no-hf \
      --json "$OUT/throughput-$m-$side.json" 2>&1 | grep -v "it/s\]\|tok/s\]" | grep -E "^minillm:|output tok/s|^ *minillm " \
      | sed "s/^/$m $side: /" | tee -a "$OUT/host-ab.log"
  done
done
cd "$OUT" && tar czf /tmp/host_ab.tgz . && find . -type f -delete && mv /tmp/host_ab.tgz . && ls -la
