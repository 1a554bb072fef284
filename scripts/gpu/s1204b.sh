#!/usr/bin/env bash
# 2026-12-04, second session (issues 43-47, 49): calls back to back (the machine stays warm 30 s), each under
# the 64 MiB carry limit: the embedded model in thirds (.gpu/m00..m02, `split -n 3 -d`) and the wheels in thirds
# (.gpu/wh1..3, from ../shared/tools/gpu-wheelhouse.sh without what the image has).
#   P1 carry [".gpu/m00", ".gpu/wh1"]   P2 carry [".gpu/m01", ".gpu/wh2"]
#   P3 carry [".gpu/m02", ".gpu/wh3", ".gpu/model.sha256"]: model checked, minillm installed, env recorded
#   T  the new paths' tests natively (TESTS to override)
#   N  notebooks executed in place (NBS="14_structured_output 15_..."), each writing its bench JSON under $OUT
#   X  a command line of the GPU scripts (CMD)
set -uo pipefail
SITE=/tmp/minillm-site MODEL=/root/minillm-model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH MINILLM_MODEL=$MODEL PYTHONUNBUFFERED=1 MINILLM_COMMIT=${MINILLM_COMMIT:-unknown}
OUT=${OUT:-/tmp/s1204b}; mkdir -p "$OUT"
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$@"; }
case "$1" in
  P1) mkdir -p "$(dirname $MODEL)" && cat .gpu/m00 > "$MODEL.part" && pipi .gpu/wh1/*.whl
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv; date -u; } | tee "$OUT/env.log" ;;
  P2) cat .gpu/m01 >> "$MODEL.part" && pipi .gpu/wh2/*.whl ;;
  P3) cat .gpu/m02 >> "$MODEL.part" && mv "$MODEL.part" "$MODEL" && (cd "$(dirname $MODEL)" && sha256sum "$(basename $MODEL)") \
        | awk '{print $1}' | diff - <(awk '{print $1}' .gpu/model.sha256) && echo "model ok"
      pipi .gpu/wh3/*.whl && pipi --no-build-isolation . && python3 -m ipykernel install --user --name python3 >/dev/null
      python3 -c "import torch, triton, transformers, xgrammar, peft, minillm; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'xgrammar', xgrammar.__version__, 'peft', peft.__version__, 'commit', '$MINILLM_COMMIT')" | tee -a "$OUT/env.log" ;;
  T)  timeout ${TEST_S:-240} python3 -m pytest ${TESTS:?} -q -n 8 -rfEs -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest-gpu.log" ;;
  N)  for nb in ${NBS:?}; do
        t0=$(date +%s)
        MINILLM_BENCH_JSON="$OUT/$nb.json" timeout ${NB_S:-300} python3 -m minillm.nbrun notebooks/$nb.ipynb 2>&1 \
          | grep -v IPKernelApp | tail -15 > "$OUT/$nb.log"; echo "$nb rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" | tee -a "$OUT/notebooks.log"
        cp notebooks/$nb.ipynb "$OUT/"
      done ;;
  X)  bash -c "${CMD:?}" 2>&1 | tail -60 | tee -a "$OUT/x.log" ;;
esac
