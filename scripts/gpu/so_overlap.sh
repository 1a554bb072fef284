#!/usr/bin/env bash
# Issue 47 (branch sooverlap): constrained decode with overlap kept, on one H200. Run after `s1204.sh A`, `B` and
# `NB_S=1 s1204.sh C` (C's wheels: xgrammar, jsonschema; NB_S=1 skips its notebook) in the same warm machine;
# this reinstalls this tree's minillm, then
#   1. scripts/gpu/structured_ablation.py, our backend then xgrammar: free / grammar / stub grammar, overlap on
#      and off, bs1 and bs64 half constrained, 3 rotated repeats, a profiler table per overlap mode (~90 s each)
#   2. `minillm bench structured --parts decode` as in chapters/bench/h200-2026-12-04-structured/ (~40 s)
#   3. the new paths' GPU tests natively (~60 s)
# Everything under $OUT: structured-ablation-{minillm,xgrammar}.json/.log, structured-profile-*.txt,
# structured-decode-minillm.json/.log, pytest-gpu.log.
set -uo pipefail
SITE=/tmp/minillm-site MODEL=/root/minillm-model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH MINILLM_MODEL=$MODEL PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/so_overlap}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade . 2>&1 | tail -2
for b in minillm xgrammar; do
  timeout 200 python3 scripts/gpu/structured_ablation.py --backend $b --json "$OUT/structured-ablation-$b.json" \
    $([ $b = minillm ] && echo --profile-dir "$OUT") > "$OUT/structured-ablation-$b.log" 2>&1
  tail -30 "$OUT/structured-ablation-$b.log"
done
timeout 120 python3 -m minillm bench structured --parts decode --repeats 3 --batch-sizes 1 64 --max-tokens 64 \
  --json "$OUT/structured-decode-minillm.json" > "$OUT/structured-decode-minillm.log" 2>&1
tail -8 "$OUT/structured-decode-minillm.log"
timeout 150 python3 -m pytest tests/test_structured_overlap.py tests/test_kernels_token_bitmask.py tests/test_overlap.py \
  tests/test_structured_engine.py -q -n 4 -rfEs -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest-gpu.log"
