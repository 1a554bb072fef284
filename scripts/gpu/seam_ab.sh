#!/usr/bin/env bash
# Issue 42 (the worker samples): this tree against a before tree, on one GPU, dummy weights, no model file.
#   bench throughput for SmolLM2-135M and Qwen3-0.6B, before/after alternating (B A B A B A per model), then
#   bench profile at batch 1 and 256, overlap on and off, each side. Carry [".wt/b"] (BEFORE: its commit,
#   a plain copy: git archive BEFORE minillm kernels pyproject.toml README.md | tar -x -C .wt/b).
#   `python3 -P`: without it `-m minillm` imports the package in the working directory on both sides.
set -uo pipefail
OUT=${OUT:-/tmp/seam-ab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for side in before after; do
  src=$([ $side = before ] && echo .wt/b || echo .)
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site-$side "$src" >/dev/null 2>&1
done
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "before ${BEFORE:-unknown} after ${AFTER:-unknown}"; } | tee "$OUT/env.log"
for rep in ${REPS:-1 2 3}; do
  for m in ${MODELS:-smollm2-135m qwen3-0.6b}; do
    for side in before after; do
      PYTHONPATH=/tmp/site-$side timeout ${RUN_S:-100} python3 -P -m minillm bench throughput --model "$m-dummy" \
        --no-hf --json "$OUT/throughput-$m-$side-$rep.json" > "$OUT/throughput-$m-$side-$rep.log" 2>&1
      echo "$m $side rep $rep: $(grep -E 'output tok/s' "$OUT/throughput-$m-$side-$rep.log" | tail -1)" | tee -a "$OUT/ab.log"
    done
  done
done
for side in ${PROFILE_SIDES:-}; do
  PYTHONPATH=/tmp/site-$side timeout 150 python3 -P -m minillm bench profile --model smollm2-135m-dummy \
    --batch-sizes 1,256 --json "$OUT/profile-$side.json" > "$OUT/profile-$side.log" 2>&1
  tail -30 "$OUT/profile-$side.log"
done
