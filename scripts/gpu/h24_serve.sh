#!/usr/bin/env bash
# Chapter 12, second pass (issue 24): `minillm serve` vs LLM.generate on the same 384 requests (embedded
# model, rate inf, token-id prompts, ignore_eos), engine core in its own process and in a thread, measured
# with the aiohttp client in a process of its own and the offline side in a process of its own
# (minillm.bench.serve_overhead); then `minillm bench serve` (same client) against a process-core server:
# 384 requests at rate inf, 128 at 32 req/s. Run from the repo root of a machine prepared as scripts/gpu/README.md says:
#   scripts/gpu/h24_serve.sh "$OUT"
# -> $OUT/serve-overhead.json (one object per engine core: served/offline tok/s, ratio, engine steps
#    served and offline, CPU seconds of the API loop / other threads / core process / client / offline),
#    $OUT/bench-serve-inf.json, $OUT/bench-serve-32.json, $OUT/h24.log. About 4-5 minutes on an H100
#    (each stage has its own timeout; the whole stays under 6).
set -uo pipefail
out=${1:-/tmp/h24-out}
mkdir -p "$out"
log="$out/h24.log"
{
  echo "date $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} | tee "$log"
timeout 30 .ci/gpu.sh exec python3 -c "import torch, aiohttp, uvicorn, importlib.util as u; print('torch', torch.__version__, \
'aiohttp', aiohttp.__version__, 'uvicorn', uvicorn.__version__, 'uvloop', u.find_spec('uvloop') is not None, \
'httptools', u.find_spec('httptools') is not None)" 2>&1 | tail -1 | tee -a "$log"

# 1. served vs offline, both engine cores (process first: the design chapter 12 teaches)
timeout 225 .ci/gpu.sh exec python3 -m minillm.bench.serve_overhead --device cuda --num-prompts 384 \
  --input-len 128 512 --output-len 64 256 --engine-core process thread --json "$out/serve-overhead.json" \
  2>&1 | grep -v -i "capturing\|warn" | tee -a "$log"

# 2. minillm bench serve against a process-core server: the burst at rate inf, then Poisson at 32 req/s
timeout 100 .ci/gpu.sh exec bash -c '
  python3 -m minillm serve --port 8024 --no-access-log --log-level warning --engine-core process > '"$out"'/serve.log 2>&1 &
  pid=$!
  for i in $(seq 60); do curl -sf localhost:8024/health >/dev/null && break; sleep 1; done
  timeout 20 python3 -m minillm bench serve --base-url http://127.0.0.1:8024 --num-prompts 384 \
    --min-input-len 128 --max-input-len 512 --min-output-len 64 --max-output-len 256 --prompt-format ids \
    --ignore-eos --request-rate inf --slo 250,25 --no-progress --output-json '"$out"'/bench-serve-inf.json
  timeout 18 python3 -m minillm bench serve --base-url http://127.0.0.1:8024 --num-prompts 128 \
    --min-input-len 128 --max-input-len 512 --min-output-len 64 --max-output-len 256 --prompt-format ids \
    --ignore-eos --request-rate 32 --slo 250,25 --no-progress --output-json '"$out"'/bench-serve-32.json
  curl -s localhost:8024/metrics | grep -E "^minillm_(engine_steps_total|generation_tokens_total|requests_total)"
  kill -TERM $pid; wait $pid' 2>&1 | tee -a "$log"
