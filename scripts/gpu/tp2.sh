#!/usr/bin/env bash
# Chapter 11 on a machine with two or more GPUs (issue 28). One part per call, each under its own `timeout`:
#   bash scripts/gpu/tp2.sh check     the GPUs, their links (nvidia-smi topo), versions, NCCL/NVLS environment
#   bash scripts/gpu/tp2.sh tests     the TP tests natively: NCCL, one GPU per rank (3-rank cases skip on 2 GPUs)
#   bash scripts/gpu/tp2.sh sweep     NCCL all-reduce 8 KB ... 64 MB, eager and in a CUDA graph, alpha-beta fits;
#                                     then gloo on CUDA tensors up to 1 MB (the one-GPU baseline, slower)
#   bash scripts/gpu/tp2.sh latency   bench latency, Llama-3-8B dummy, TP 1 and 2 (needs the multi-process executor)
#   bash scripts/gpu/tp2.sh throughput qwen3-0.6b | llama-3-8b    bench throughput at TP 1 and 2 (same)
#   bash scripts/gpu/tp2.sh notebook  notebook 11 re-run on these GPUs (needs notebooks/11_*.ipynb)
#   bash scripts/gpu/tp2.sh all       check, tests, sweep (about 8 minutes)
# Logs and JSON land in $OUT. NVLink multicast stays as the machine sets it (NCCL_NVLS_ENABLE=0): never override it.
set -uo pipefail
OUT=${OUT:-/tmp/tp2-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TORCHRUN="python3 -m torch.distributed.run --nproc-per-node 2"

check() {
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  { nvidia-smi -L; nvidia-smi topo -m; env | grep -E "^(NCCL_|TORCH_SYMM)" | sort
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
    git rev-parse --short HEAD 2>/dev/null; date -u; } 2>&1 | tee "$OUT/tp2-check.log"
  if [ "$NGPU" -lt 2 ]; then echo "only $NGPU GPU(s): tensor parallelism with NCCL needs 2" | tee -a "$OUT/tp2-check.log"; return 1; fi
}

tests() {  # the two-GPU engine tests first (CUDA graphs, NCCL), then the rest of chapter 11's tests
  MINILLM_TP_BACKEND=nccl timeout ${GPU_TESTS_S:-200} python3 -m pytest tests/test_tp_engine.py tests/test_tp_launch.py -k "two_gpus" \
    -q -p no:cacheprovider -rs --durations=5 2>&1 | tail -15 | tee "$OUT/tp2-tests-gpu.log"
  MINILLM_TP_BACKEND=nccl timeout ${TESTS_S:-240} python3 -m pytest tests/test_distributed.py tests/test_tp_model.py \
    tests/test_tp_layers.py tests/test_distributed_cost_model.py tests/test_tp_moe.py tests/test_tp_mla.py \
    tests/test_tp_engine.py -k "not embedded and not two_gpus" \
    -q -p no:cacheprovider -rs --durations=10 2>&1 \
    | tail -40 | tee "$OUT/tp2-tests.log"
}

sweep() {
  timeout 180 $TORCHRUN scripts/gpu/allreduce_sweep.py --backend nccl --json "$OUT/allreduce-nccl-tp2.json" 2>&1 \
    | grep -v "^\*\*\*\|OMP_NUM_THREADS" | tee "$OUT/allreduce-nccl.log"
  [ -z "${GLOO:-}" ] || timeout 100 $TORCHRUN scripts/gpu/allreduce_sweep.py --backend gloo --max-sizes 8 --iters 20 \
    --json "$OUT/allreduce-gloo-cuda-tp2.json" 2>&1 | grep -v "^\*\*\*\|OMP_NUM_THREADS" | tee "$OUT/allreduce-gloo.log"
}

has_tp_bench() {
  python3 -m minillm bench latency --help 2>&1 | grep -q -- "--tensor-parallel-size" && return 0
  echo "minillm bench has no --tensor-parallel-size yet (the multi-process executor, issue 27): nothing run" \
    | tee "$OUT/tp2-bench.log"; return 3
}

latency() {  # batch-1 decode, Llama-3-8B with dummy weights, TP 1 then 2 back to back
  has_tp_bench || return 3
  for tp in 1 2; do
    timeout ${BENCH_S:-270} python3 -m minillm bench latency --model llama-3-8b-dummy --no-hf --tensor-parallel-size $tp \
      --json "$OUT/latency-llama-3-8b-tp$tp.json" 2>&1 | grep -v "it/s\]" | tail -14
  done 2>&1 | tee "$OUT/tp2-latency.log"
}

throughput() {  # the throughput workload on one model ($1: qwen3-0.6b or llama-3-8b), TP 1 then 2
  has_tp_bench || return 3
  for tp in 1 2; do
    timeout ${BENCH_S:-270} python3 -m minillm bench throughput --model "$1-dummy" --no-hf --tensor-parallel-size $tp \
      --json "$OUT/throughput-$1-tp$tp.json" 2>&1 | grep -v "it/s\]" | tail -14
  done 2>&1 | tee "$OUT/tp2-throughput-$1.log"
}

notebook() {
  nb=$(ls notebooks/11_*.ipynb 2>/dev/null | head -1)
  if [ -z "$nb" ]; then echo "no notebooks/11_*.ipynb yet: nothing run" | tee "$OUT/tp2-notebook.log"; return 3; fi
  timeout ${NB_S:-580} python3 -m minillm.nbrun "$nb" 2>&1 | tail -30 | tee "$OUT/tp2-notebook.log"
  cp "$nb" "$OUT/"
}

case "${1:-all}" in
  check) check ;;
  tests) tests ;;
  sweep) sweep ;;
  latency) latency ;;
  throughput) throughput "${2:-qwen3-0.6b}" ;;
  notebook) notebook ;;
  all) check && { tests; sweep; } ;;
  *) echo "usage: $0 check|tests|sweep|latency|throughput MODEL|notebook|all"; exit 2 ;;
esac
