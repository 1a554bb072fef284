#!/usr/bin/env bash
# Notebook 12 on one GPU (issue 24 item 5: the engine core in its own process measured), executed in place.
# Two calls on one warm machine: the embedded model travels in two halves, because a call carries at most
# 64 MiB (model-a 50.0 MB + the nb wheels 5.4 MB; model-b 48.4 MB + the serve wheels 12.0 MB). Send a
# trimmed tree (the package, kernels, scripts and this notebook: 1.9 MB; the whole tree is 9.6 MB, too much
# for call B), made from the branch's files without notebooks/, chapters/ and tests/:
#
#   rm -rf /work/main/.wt/nb12p && mkdir -p /work/main/.wt/nb12p && cd /work/wt/nb12p && \
#   { git ls-files -co --exclude-standard | grep -v -E '^(notebooks|chapters|tests)/'; \
#     echo notebooks/12_serving.ipynb; } | tar -cf - -T - | tar -xf - -C /work/main/.wt/nb12p
#   call A, carry [".wt/nb12p", ".gpu/model-a", ".gpu/nb"]:
#     cd .wt/nb12p && bash scripts/gpu/nb12.sh A
#   call B, carry [".wt/nb12p", ".gpu/model-b", ".gpu/serve"]:
#     cd .wt/nb12p && COMMIT=<short hash of the tree sent> bash scripts/gpu/nb12.sh B
#
# A installs the notebook wheels (ipykernel, nbclient, gguf, ...) and minillm, and starts the model file.
# B finishes the model file, installs the serve wheels (fastapi, uvicorn, pydantic, httptools, ...; the image
# has aiohttp, httpx, uvloop and prometheus-client), then runs notebooks/12_serving.ipynb under NB_TIMEOUT
# seconds (default 420; it takes about 3-4 minutes on an H100/H200) and brings back to $OUT:
#   12_serving.ipynb (executed: copy it over notebooks/12_serving.ipynb), nb12.log (per-cell times),
#   serve-sweep.json, serve-streams.json, serve-overhead.json (the rows the notebook measured; commit these
#   three in chapters/bench/<gpu>-<date>/ with the log).
# GPU_DIR: where .gpu is, seen from the tree (default ../../.gpu, the run's repository root).
set -uo pipefail
GPU_DIR=${GPU_DIR:-../../.gpu}
SITE=/tmp/minillm-site
MODEL=/root/minillm-model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1 MINILLM_MODEL=$MODEL TOKENIZERS_PARALLELISM=false
[ -z "${COMMIT:-}" ] || export MINILLM_COMMIT=$COMMIT
out=${OUT:-/tmp/nb12-out}; mkdir -p "$out"
case "${1:-}" in
  A)
    mkdir -p "$(dirname $MODEL)" && rm -f "$MODEL.part" && cat "$GPU_DIR"/model-a > "$MODEL.part"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$GPU_DIR"/nb/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE .
    python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; ls -la "$MODEL.part"
    ;;
  B)
    [ -f "$MODEL.part" ] || { echo "no $MODEL.part: call A did not run on this machine (it went back?)"; exit 1; }
    cat "$GPU_DIR"/model-b >> "$MODEL.part" && mv "$MODEL.part" "$MODEL" && ls -la "$MODEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$GPU_DIR"/serve/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
    {
      echo "date $(date -u +%FT%TZ) commit ${COMMIT:-unknown}"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch, aiohttp, uvicorn, fastapi, importlib.util as u; print('torch', torch.__version__, \
'aiohttp', aiohttp.__version__, 'uvicorn', uvicorn.__version__, 'fastapi', fastapi.__version__, \
'uvloop', u.find_spec('uvloop') is not None, 'httptools', u.find_spec('httptools') is not None)"
    } 2>&1 | tee "$out/nb12.log"
    MINILLM_BENCH_OUT=$out timeout "${NB_TIMEOUT:-420}" python3 -m minillm.nbrun notebooks/12_serving.ipynb 2>&1 \
      | grep -v IPKernelApp | tee -a "$out/nb12.log"
    echo "rc=${PIPESTATUS[0]}" | tee -a "$out/nb12.log"
    cp notebooks/12_serving.ipynb "$out/"
    ls -la "$out"
    ;;
  *) echo "usage: $0 A | B   (see the top of this file)" >&2; exit 2 ;;
esac
