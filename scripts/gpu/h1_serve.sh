#!/usr/bin/env bash
# Chapter 12 (serving) on the GPU machine. Run from the repo root after `.ci/gpu.sh setup DIR` and
# `.ci/gpu.sh model DIR`, with a wheelhouse built by
#   EXTRA_WHEELS="fastapi uvicorn openai" ../shared/tools/gpu-wheelhouse.sh DIR
# Stages (each well under 10 minutes):
#   .gpu/h1_serve.sh check            the server's packages import (fastapi, uvicorn, pydantic, openai)
#   .gpu/h1_serve.sh tests  "$OUT"    the serving tests on the GPU machine (256 concurrent clients there)
#   .gpu/h1_serve.sh bench  "$OUT"    minillm serve on the GPU + minillm bench serve at three rates -> JSON
#   .gpu/h1_serve.sh notebook "$OUT"  notebook 12 executed in place (GPU outputs), copied to $OUT
set -uo pipefail
stage=$1 out=${2:-/tmp/h1-out}
mkdir -p "$out"
case "$stage" in
  check)
    .ci/gpu.sh exec python3 -c "import fastapi, uvicorn, pydantic, starlette, openai, httpx, prometheus_client; \
print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.VERSION, 'openai', openai.__version__)"
    ;;
  tests)
    .ci/gpu.sh pytest "$out" tests/test_serve.py tests/test_serve_lifecycle.py tests/test_async_engine.py \
      tests/test_bench_serve.py   # (test_chat_page.py needs Chromium, which the GPU image lacks)
    ;;
  bench)
    .ci/gpu.sh exec bash -c '
      python3 -m minillm serve --port 8011 --no-access-log --gpu-memory-utilization 0.6 > '"$out"'/serve.log 2>&1 &
      pid=$!
      for i in $(seq 300); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
      for rate in 16 64 inf; do
        timeout 150 python3 -m minillm bench serve --base-url http://127.0.0.1:8011 --num-prompts 256 \
          --min-input-len 128 --max-input-len 512 --min-output-len 64 --max-output-len 256 --prompt-format ids \
          --ignore-eos --request-rate $rate --slo 250,25 --no-progress --output-json '"$out"'/bench-serve-$rate.json \
          2>&1 | tee -a '"$out"'/bench-serve.log
      done
      timeout 120 python3 -m minillm bench serve --base-url http://127.0.0.1:8011 --endpoint chat --workload prompts \
        --num-prompts 64 --max-tokens 128 --request-rate 8 --slo 250,25 --no-progress \
        --output-json '"$out"'/bench-serve-chat.json 2>&1 | tee -a '"$out"'/bench-serve.log
      kill -TERM $pid; wait $pid'
    ;;
  notebook)
    NB_TIMEOUT=560 .ci/gpu.sh notebooks "$out" notebooks/12_serving.ipynb
    cp notebooks/12_serving.ipynb "$out"/
    ;;
  *) echo "usage: $0 check | tests OUT | bench OUT | notebook OUT" >&2; exit 2 ;;
esac
