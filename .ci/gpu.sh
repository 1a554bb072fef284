#!/usr/bin/env bash
# How the stored notebook outputs are made, on an offline GPU machine that already has torch,
# triton, transformers and matplotlib (see README, "Running on a GPU"). Run from the repo root:
#
#   .ci/gpu.sh setup DIR      install the wheels in DIR/wheels; start the model file from DIR/model-a
#   .ci/gpu.sh model DIR      finish the model file with DIR/model-b
#   .ci/gpu.sh run OUT [NB..] the test suite on the GPU, then every notebook (or those named) executed
#                             in place; logs and the executed notebooks go to OUT
#   .ci/gpu.sh test OUT       the test suite alone;  .ci/gpu.sh notebooks OUT [NB..]: the notebooks alone
#                             (each under NB_TIMEOUT seconds, default 540; a cell's time is printed as it ends,
#                             and a notebook cut short keeps the outputs of the cells that ran)
#   .ci/gpu.sh kernels OUT    the kernel and cache tests, then `minillm bench attention` (a quick look)
#   .ci/gpu.sh pytest OUT F.. the named test files;  .ci/gpu.sh exec CMD..: any command, with this env
set -euo pipefail
SITE=/tmp/minillm-site
MODEL=/root/minillm-model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH MINILLM_MODEL=$MODEL PYTHONUNBUFFERED=1
case "$1" in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$2"/wheels/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE .
    python3 -m ipykernel install --user --name python3 >/dev/null
    mkdir -p "$(dirname $MODEL)" && rm -f "$MODEL.part" && cat "$2"/model-a > "$MODEL.part"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton, transformers, minillm; print(torch.__version__, triton.__version__, transformers.__version__, minillm.__file__)"
    ;;
  model)
    cat "$2"/model-b >> "$MODEL.part" && mv "$MODEL.part" "$MODEL" && ls -la "$MODEL"
    ;;
  run|test|notebooks)
    cmd=$1 out=$2; mkdir -p "$out"
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
    [ "$cmd" = notebooks ] || python3 -m pytest tests/ -q -n 8 -rfEs -p no:cacheprovider --ignore=tests/test_site.py --ignore=tests/test_notebook_files.py \
      2>&1 | tee "$out/pytest-gpu.log" || true
    [ "$cmd" != test ] || exit 0
    shift 2
    nbs=("$@"); [ ${#nbs[@]} -gt 0 ] || nbs=(notebooks/[0-9]*.ipynb notebooks/labs/[0-9]*.ipynb)
    for nb in "${nbs[@]}"; do  # each notebook under its own limit, so the tar below always runs
      timeout "${NB_TIMEOUT:-540}" python3 -m minillm.nbrun "$nb" 2>&1 | grep -v IPKernelApp | tee -a "$out/notebooks.log" || true
    done
    tar czf "$out/notebooks.tgz" notebooks/*.ipynb notebooks/labs/*.ipynb
    ;;
  kernels)
    out=$2; mkdir -p "$out"
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
    python3 -m pytest tests/test_kernels_*.py tests/test_kv_cache.py -q -n 8 -rfEs -p no:cacheprovider \
      2>&1 | tee "$out/pytest-kernels.log" || true
    python3 -m minillm bench attention 2>&1 | tee "$out/bench-attention.log" || true
    ;;
  pytest)
    out=$2; shift 2; mkdir -p "$out"
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
    python3 -m pytest "$@" -q -n 8 -rfEs -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.log" || true
    ;;
  exec)
    shift  # SKIP_INSTALL=1: installed already (scripts/gpu/pair.sh runs two jobs on one install)
    [ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
    "$@"
    ;;
  *) echo "usage: $0 setup DIR | model DIR | run|notebooks OUT [NB..] | test OUT | kernels OUT | pytest OUT F.. | exec CMD.." >&2; exit 2 ;;
esac
