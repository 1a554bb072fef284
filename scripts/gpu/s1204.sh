#!/usr/bin/env bash
# 2026-12-04 (issues 42, 45, 47): three calls back to back, each under the 64 MiB carry limit.
#   A  carry [".gpu/model-a", ".gpu/wh1"]: the first half of the embedded model, half the wheels
#   B  carry [".gpu/model-b", ".gpu/wh2"]: the second half, the rest of the wheels; minillm installed; the new
#      and changed paths' tests natively (TESTS to override)
#   C  no carry: notebook 14 executed in place (it runs the full `bench structured`), the xgrammar backend's
#      decode, the KV-transfer bandwidth
# The wheels: EXTRA_WHEELS="pydantic fastapi uvicorn httptools uvloop httpx opentelemetry-api jsonschema"
#   NODEPS_WHEELS="xgrammar apache-tvm-ffi peft accelerate" ../shared/tools/gpu-wheelhouse.sh DIR, split in two.
set -uo pipefail
SITE=/tmp/minillm-site MODEL=/root/minillm-model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH MINILLM_MODEL=$MODEL PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/s1204}; mkdir -p "$OUT"
case "$1" in
  A)
    mkdir -p "$(dirname $MODEL)" && cat .gpu/model-a > "$MODEL.part"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu/wh1/*.whl
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; date -u
      git log -1 --format='commit %H %s' 2>/dev/null || true; } | tee "$OUT/env.log"
    ;;
  B)
    cat .gpu/model-b >> "$MODEL.part" && mv "$MODEL.part" "$MODEL" && ls -la "$MODEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu/wh2/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE .
    python3 -m ipykernel install --user --name python3 >/dev/null
    python3 -c "import torch, triton, transformers, xgrammar, minillm; print(torch.__version__, triton.__version__, transformers.__version__, xgrammar.__version__)" | tee -a "$OUT/env.log"
    timeout ${TEST_S:-330} python3 -m pytest ${TESTS:-tests/test_fake_executor.py tests/test_forward_context.py \
      tests/test_structured_engine.py tests/test_structured_backends.py tests/test_structured_output.py \
      tests/test_serve_structured.py tests/test_serve_tools.py tests/test_kv_transfer.py tests/test_engine.py \
      tests/test_overlap.py tests/test_spec_engine.py tests/test_sampling.py tests/test_rejection_sampler.py} \
      -q -n 8 -rfEs -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest-gpu.log"
    ;;
  C)
    # the notebook runs the full bench (minillm's backend) and writes its JSON; then the xgrammar backend's decode
    MINILLM_BENCH_JSON="$OUT/structured-minillm.json" timeout ${NB_S:-330} python3 -m minillm.nbrun \
      notebooks/14_structured_output.ipynb 2>&1 | grep -v IPKernelApp | tail -15 | tee "$OUT/notebook14.log"
    cp notebooks/14_structured_output.ipynb "$OUT/"
    timeout 150 python3 -m minillm bench structured --structured-outputs-backend xgrammar --parts decode \
      --json "$OUT/structured-xgrammar.json" > "$OUT/structured-xgrammar.log" 2>&1; tail -12 "$OUT/structured-xgrammar.log"
    for c in SharedPoolConnector SharedStorageConnector; do
      CONNECTOR=$c timeout 60 python3 scripts/gpu/kv_transfer_bw.py 2>&1 | tail -3 | tee -a "$OUT/kv-bw.log"
    done
    ;;
esac
