#!/usr/bin/env bash
# Chapter 12 (issue 24): why the served engine steps more often than LLM.generate, on the GPU. The same
# 384 requests as serve_overhead (embedded model, rate inf, token-id prompts, ignore_eos), engine core in
# its own process, every step traced (scripts/serve_steps_cpu.py): first with the commands sent as each
# handler queues them (this tree), then the A/B with the old once-per-loop-pass send (--send-per-pass),
# then this tree again under cProfile (engine core and offline run). Run from the repo root of a machine
# prepared as scripts/gpu/README.md says:
#   scripts/gpu/serve_steps.sh "$OUT"
# -> $OUT/steps-after.json, steps-before.json, steps-profile.json (intake times, steps per phase, batch
#    sizes, CPU split) and $OUT/serve-steps.log. About 2 minutes a run on an H100.
set -uo pipefail
out=${1:-/tmp/serve-steps-out}
mkdir -p "$out"
log="$out/serve-steps.log"
{
  echo "date $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} | tee "$log"
run() {  # name, extra flags
  echo "== $1" | tee -a "$log"
  timeout 240 .ci/gpu.sh exec python3 scripts/serve_steps_cpu.py --device cuda --emulate "" \
    --json "$out/steps-$1.json" "${@:2}" 2>&1 | grep -v -i "capturing\|warn" | tee -a "$log"
}
run after
run before --send-per-pass
run profile --profile
