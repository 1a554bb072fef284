#!/usr/bin/env bash
# Notebook 09 and lab 09 (speculative decoding) executed in place on the GPU machine, then the GPU oracle of
# chapter 09 (the embedded model in fp32 with CUDA graphs speculates to the plain greedy tokens). Run after
# `.ci/gpu.sh setup .gpu` and `.ci/gpu.sh model .gpu`, with MINILLM_CORPUS pointing at the corpus file (the
# grounded prompts quote its passages; without it the benchmark's built-in paragraph stands in):
#   OUT=/some/dir bash scripts/gpu/nb09.sh
# Writes $OUT/notebooks.log (each cell's time), the two executed notebooks (to commit) and $OUT/spec-gpu-tests.log.
# Expected: about 3-4 minutes on an H100.
set -uo pipefail
OUT=${OUT:-/tmp/nb09-out}; mkdir -p "$OUT"
NB_TIMEOUT=420 .ci/gpu.sh notebooks "$OUT" notebooks/09_speculative_decoding.ipynb notebooks/labs/09_speculative_decoding.ipynb
cp notebooks/09_speculative_decoding.ipynb "$OUT/"
cp notebooks/labs/09_speculative_decoding.ipynb "$OUT/lab_09_speculative_decoding.ipynb"
grep -n "09_speculative" "$OUT/notebooks.log" | tail -30
timeout 150 python3 -m pytest tests/test_spec_engine.py -k gpu -q -p no:cacheprovider -rs 2>&1 | tail -5 \
  | tee "$OUT/spec-gpu-tests.log"
