#!/usr/bin/env bash
# Chapter 12 follow-up (h6): the server vs LLM.generate on the same 384 requests, on the GPU, with
# Python's GIL switch interval left alone and at 0.5 ms. Run from the repo root after
# `.ci/gpu.sh setup DIR` and `.ci/gpu.sh model DIR` (setup installs this checkout), then:
#   .gpu/h6_serve_perf.sh "$OUT"          -> $OUT/serve-overhead.log (about 3 minutes)
# and notebook 12 again:  .gpu/h1_serve.sh notebook "$OUT"
set -uo pipefail
out=${1:-/tmp/h6-out}
mkdir -p "$out"
for sw in default 0.5 default 0.5; do
  args=""
  [ "$sw" != default ] && args="--switch-interval-ms $sw"
  echo "=== switch interval: $sw" | tee -a "$out/serve-overhead.log"
  timeout 240 .ci/gpu.sh exec python3 -m minillm.bench.serve_overhead --device cuda --num-prompts 384 \
    --input-len 128 512 --output-len 64 256 --serve-args "$args" 2>&1 | grep -v -i "capturing\|warn" \
    | tee -a "$out/serve-overhead.log"
done
