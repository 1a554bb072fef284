#!/usr/bin/env bash
# Chapter 12 follow-up (h6, issue 19's throughput target): `minillm serve` vs LLM.generate on the same
# 384 requests (embedded model, rate inf), with the engine core in a thread and in its own process
# (--engine-core thread|process), twice each, alternating. Run from the repo root after
# `.ci/gpu.sh setup DIR` and `.ci/gpu.sh model DIR` (setup installs this checkout), then:
#   scripts/gpu/h6_serve_perf.sh "$OUT"   -> $OUT/serve-overhead.json (one object per measurement:
#        served_tps, offline_tps, ratio, CPU seconds of the API loop / other threads / core process)
#        and $OUT/serve-overhead.log (the same, as text); about 4-6 minutes
# and notebook 12 again:  scripts/gpu/h1_serve.sh notebook "$OUT"
set -uo pipefail
out=${1:-/tmp/h6-out}
mkdir -p "$out"
timeout 570 .ci/gpu.sh exec python3 -m minillm.bench.serve_overhead --device cuda --num-prompts 384 \
  --input-len 128 512 --output-len 64 256 --engine-core thread process --repeat 2 \
  --json "$out/serve-overhead.json" 2>&1 | grep -v -i "capturing\|warn" | tee "$out/serve-overhead.log"
