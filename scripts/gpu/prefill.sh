#!/usr/bin/env bash
# Prefill attention on one H100 (issue 26 item 3), one device call of under 4 minutes, from this tree's root:
#   1. installs the wheels and minillm into $SITE (as RULES.md's run command does)
#   2. bench attention, prefill only, Llama-3-8B shapes (512 ... 8k tokens, one sequence and 4 packed):
#      the kernel (tuned: TMA, GQA grid, Hopper tiles) beside its v0 settings (before) and SDPA's flash and
#      cuDNN backends, each forced; ratios per row                      -> prefill-bench.log, attention.json
#   3. the prefill kernel's tests natively (small shapes in every variant, real model shapes in bf16)
#                                                                       -> prefill-tests.log
#   4. the ablations at 1k and 4k tokens, each change removed alone (no-tma, head-grid), and one sequence
#      through a paged cache of 16-token blocks (the engine's prefill path)  -> prefill-ablation.log, ablation.json
# Each part runs under `timeout`, so the script always ends with its archive: $OUT/prefill-results.tgz.
# WHEELS: the wheel folder (default .gpu/wheels here, or ../../.gpu/wheels from .wt/<name>); COMMIT: the
# commit the numbers belong to (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/prefill-out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-$( [ -d .gpu/wheels ] && echo .gpu/wheels || echo ../../.gpu/wheels )}
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 MINILLM_COMMIT=${COMMIT:-unknown}
LENGTHS=${LENGTHS:-512,1024,2048,4096,8192} MODELS=${MODELS:-Llama-3-8B} ABLATION_LENGTHS=${ABLATION_LENGTHS:-1024,4096}
start=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - start )) s"; }

stamp install
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
timeout 60 python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" .
{ date -u; echo "commit $MINILLM_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee "$OUT/prefill-header.log"

bench() {  # name, seconds, lengths, options
  local name=$1 limit=$2 lengths=$3; shift 3
  timeout "$limit" python3 -m minillm bench attention --only prefill --models "$MODELS" --prefill-lengths "$lengths" \
    "$@" --json "$OUT/$name.json" 2>&1 | grep -v "it/s\]" > "$OUT/prefill-$name.log"
  echo "exit $? (124 = timed out)" >> "$OUT/prefill-$name.log"
  tail -18 "$OUT/prefill-$name.log"
}

stamp bench
bench attention 90 "$LENGTHS" --variants v0
mv "$OUT/prefill-attention.log" "$OUT/prefill-bench.log"

stamp tests
# xdist spreads the compiles over cores when the image has it
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
timeout 70 python3 -m pytest -q -p no:cacheprovider -rfEs --durations=6 $workers \
  tests/test_kernels_attention.py tests/test_kv_quant.py -k "flash_attn or references" > "$OUT/prefill-tests.log" 2>&1
echo "exit $? (124 = timed out)" >> "$OUT/prefill-tests.log"
tail -14 "$OUT/prefill-tests.log"

stamp ablation
bench ablation 65 "$ABLATION_LENGTHS" --variants no-tma,head-grid --paged 16

stamp done
# at most 8 files come back: everything in one archive (written outside the folder it reads)
cd "$OUT" && tar czf /tmp/prefill-results.tgz . && find . -type f -delete && mv /tmp/prefill-results.tgz . && ls -la
