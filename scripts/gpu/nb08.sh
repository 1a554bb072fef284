#!/usr/bin/env bash
# Notebook 08 (quantization) executed in place on the GPU machine, after `.ci/gpu.sh setup .gpu` and
# `.ci/gpu.sh model .gpu` (the embedded model file must be in place: sections 5 and 6 load it).
#   OUT=/some/dir bash .gpu/nb08.sh
# Writes $OUT/notebooks.log (each cell's time), $OUT/notebooks.tgz and $OUT/08_quantization.ipynb
# (the executed notebook, to commit). Expected: about 5-7 minutes on an H100; NB_TIMEOUT stops it at
# 560 s, keeping the outputs of the cells that ran.
set -uo pipefail
OUT=${OUT:-/tmp/nb08-out}; mkdir -p "$OUT"
NB_TIMEOUT=560 .ci/gpu.sh notebooks "$OUT" notebooks/08_quantization.ipynb
cp notebooks/08_quantization.ipynb "$OUT/"
grep -n "08_quantization" "$OUT/notebooks.log" | tail -40
