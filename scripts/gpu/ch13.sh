#!/usr/bin/env bash
# Chapter 13 on the GPU machine, in two calls back to back (the embedded model travels in two halves):
#
#   call A, carry [.gpu/model-a, .gpu/min]:  bash scripts/gpu/ch13.sh A   (dummy-weight benchmarks)
#   call B, carry [.gpu/model-b, .gpu/nb]:   bash scripts/gpu/ch13.sh B   (GPU tests: TESTS="...")
#   call C, on the same warm machine:        bash scripts/gpu/ch13.sh C   (notebooks: NOTEBOOKS="...")
#
# .gpu/min holds the gguf wheel, .gpu/nb the Jupyter stack too (../shared/tools/gpu-wheelhouse.sh, then
# copy). Logs and JSON go to $OUT; each part runs under `timeout` so the script always ends with a tar.
set -uo pipefail
SITE=/tmp/minillm-site MODEL=/root/minillm-model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH MINILLM_MODEL=$MODEL PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MINILLM_COMMIT=${COMMIT:-unknown}  # what a notebook header records (the tree here has no .git)
part=$1; out=${OUT:?}; mkdir -p "$out"
install() {  # SKIP_INSTALL=1: scripts/gpu/pair.sh installed once for both GPUs
  [ -z "${SKIP_INSTALL:-}" ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$1"/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -40; }
case "$part" in
  A)
    install .gpu/min
    mkdir -p "$(dirname $MODEL)" && cat .gpu/model-a > "$MODEL.part"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
    echo "commit ${COMMIT:-unknown}, $(date -u +%F)" | tee -a "$out/gpu.txt"
    [ -z "${FUSED:-}" ] || run fused-bench 120 python3 scripts/gpu/fused_decode.py
    for m in ${LATENCY:-smollm2-135m qwen3-0.6b}; do
      run "latency-$m" 60 python3 -m minillm bench latency --model $m-dummy ${HF:---no-hf} --json "$out/latency-$m.json"
    done
    [ -z "${SKINNY:-}" ] || run latency-smollm2-135m-skinny 45 env MINILLM_SKINNY_GEMM=1 python3 -m minillm bench latency --model smollm2-135m-dummy --no-hf --json "$out/latency-smollm2-135m-skinny.json"
    [ -z "${LLAMA:-}" ] || run latency-llama-3-8b 80 python3 -m minillm bench latency --model llama-3-8b-dummy --no-hf --json "$out/latency-llama-3-8b.json"
    for m in ${THROUGHPUT:-smollm2-135m qwen3-0.6b}; do
      run "throughput-$m" 60 python3 -m minillm bench throughput --model $m-dummy --no-hf --json "$out/throughput-$m.json"
    done
    run profile-smollm2 100 python3 -m minillm bench profile --model smollm2-135m-dummy --batch-sizes 1,64,256 --json "$out/profile-smollm2.json"
    ;;
  B)
    install .gpu/nb
    [ -n "${SKIP_INSTALL:-}" ] || python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
    cat .gpu/model-b >> "$MODEL.part" && mv "$MODEL.part" "$MODEL" && ls -la "$MODEL"
    python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
    run pytest-gpu "${TEST_LIMIT:-420}" python3 -m pytest ${TESTS:-tests/test_overlap.py tests/test_engine.py tests/test_spec_engine.py} \
        -q -n 8 -rfEs -p no:cacheprovider
    ;;
  C)
    [ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
    for nb in ${NOTEBOOKS:-notebooks/13_fast_path.ipynb}; do
      name=$(echo "$nb" | tr / _); run "nb-$name" 300 python3 -m minillm.nbrun "$nb"; cp "$nb" "$out/$name"
    done
    ;;
esac
# at most 8 files come back: everything in one archive (written outside the folder it reads)
cd "$out" && tar czf "/tmp/results-$part.tgz" . ; find . -type f -delete; mv "/tmp/results-$part.tgz" .; ls -la
