#!/usr/bin/env bash
# 2026-12-04 (issues 42, 44, 45, 47): calls back to back, each under the 64 MiB carry limit (the tracked tree
# is ~11 MB of it). The wheels are split in three (.gpu/wh1..3, ~5.6 MB each, uvloop/peft/accelerate left out).
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
  A)  # carry [".gpu/model-a", ".gpu/wh1"]
    mkdir -p "$(dirname $MODEL)" && cat .gpu/model-a > "$MODEL.part"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu/wh1/*.whl
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; date -u; } | tee "$OUT/env.log"
    ;;
  B)  # carry [".gpu/model-b", ".gpu/wh2"]
    cat .gpu/model-b >> "$MODEL.part" && mv "$MODEL.part" "$MODEL" && ls -la "$MODEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu/wh2/*.whl
    ;;
  C)  # carry [".gpu/wh3"]: the rest of the wheels, minillm, then notebook 14 (it runs the full `bench structured`)
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu/wh3/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE .
    python3 -m ipykernel install --user --name python3 >/dev/null
    python3 -c "import torch, triton, transformers, xgrammar, minillm; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'xgrammar', xgrammar.__version__)" | tee "$OUT/env.log"
    MINILLM_BENCH_JSON="$OUT/structured-minillm.json" timeout ${NB_S:-300} python3 -m minillm.nbrun \
      notebooks/14_structured_output.ipynb 2>&1 | grep -v IPKernelApp | tail -25 | tee "$OUT/notebook14.log"
    cp notebooks/14_structured_output.ipynb "$OUT/"
    ;;
  D)  # later: the new paths' tests natively, the xgrammar backend's decode, the KV-transfer bandwidth
    timeout ${TEST_S:-330} python3 -m pytest ${TESTS:-tests/test_fake_executor.py tests/test_forward_context.py \
      tests/test_structured_engine.py tests/test_structured_backends.py tests/test_structured_output.py \
      tests/test_serve_structured.py tests/test_serve_tools.py tests/test_kv_transfer.py tests/test_lora.py \
      tests/test_kernels_lora.py tests/test_engine.py tests/test_overlap.py tests/test_spec_engine.py} \
      -q -n 8 -rfEs -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest-gpu.log"
    timeout 150 python3 -m minillm bench structured --structured-outputs-backend xgrammar --parts decode \
      --json "$OUT/structured-xgrammar.json" > "$OUT/structured-xgrammar.log" 2>&1; tail -12 "$OUT/structured-xgrammar.log"
    for c in SharedPoolConnector SharedStorageConnector; do
      CONNECTOR=$c timeout 60 python3 scripts/gpu/kv_transfer_bw.py 2>&1 | tail -3 | tee -a "$OUT/kv-bw.log"
    done
    ;;
esac
