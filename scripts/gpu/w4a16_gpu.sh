#!/usr/bin/env bash
# Chapter 08's W4A16 numbers in one GPU call (about 8 minutes on an H100; the 2026-11-25 run used
# shorter slots: its tests stopped after 38 and its int4 latency run did not finish), from the repo root:
#   OUT=/some/dir MINILLM_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/w4a16_gpu.sh
# 1. the W4A16/GEMV kernel tests natively (real Llama-3-8B shapes included)
# 2. scripts/gpu/w4sweep.py: bf16 cuBLAS vs int4 (GEMV at M <= 4) vs int8 vs torch's int4 at M = 1, 4, 16,
#    the ablations (the old tiles at M <= 4, the GEMV without split-K) and a GEMV tile sweep -> w4a16.json
# 3. Llama-3-8B (dummy weights) batch-1 latency per format -> latency-llama-3-8b-{int4,bf16,int8}.json
#    (notebook 08's engine settings: one sequence, so only its graphs are captured; the 2026-11-25 run
#    used --cuda-graph-max-tokens 4 alone and captured 20 graphs, too slow for its int4 slot)
# 4. Nsight Compute on the M = 1 GEMV: DRAM and SM throughput (% of peak)
# Every part runs under `timeout`, so the script always ends and leaves $OUT/logs.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/w4a16-out}; LOGS=/tmp/w4a16-logs
mkdir -p "$OUT" "$LOGS"
trap 'tar czf "$OUT/logs.tgz" -C "$LOGS" .' EXIT
PARTS=${PARTS:-tests sweep latency ncu}  # a subset, e.g. PARTS=latency: the end-to-end numbers alone; PARTS=stalls: ncu's warp-state sections
has() { [[ " $PARTS " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u;
  echo "commit ${MINILLM_COMMIT:-?}"; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
  > "$LOGS/env.txt" 2>&1

has tests && timeout 150 python -m pytest -q -p no:cacheprovider -rs tests/test_kernels_w4a16_gemv.py tests/test_kernels_w4a16_swap.py tests/test_kernels_w4a16_few_rows.py \
  "tests/test_kernels_w4a16.py::test_llama3_shapes_on_gpu" "tests/test_kernels_w4a16.py::test_w4a16_matches_dequantized_matmul" \
  > "$LOGS/tests.log" 2>&1; echo "tests rc=$?" >> "$LOGS/tests.log"

has sweep && timeout 95 python scripts/gpu/w4sweep.py --budget-s 65 > "$LOGS/w4sweep.log" 2>&1; echo "sweep rc=$?" >> "$LOGS/w4sweep.log"
cp "$OUT/w4a16.json" "$LOGS/" 2>/dev/null

has latency && for fmt in ${FORMATS:-int4 bf16 int8}; do  # FORMATS="int4 bf16 int8 fp8": fp8 too
  q=(); [ "$fmt" != bf16 ] && q=(--quantization "$fmt")
  timeout 80 python -m minillm bench latency --model llama-3-8b-dummy "${q[@]}" --no-hf --num-iters 2 \
    --num-iters-warmup 1 --max-num-seqs 1 --max-num-batched-tokens 256 --cuda-graph-max-tokens 0 \
    --gpu-memory-utilization 0.5 --json "$OUT/latency-llama-3-8b-$fmt.json" \
    > "$LOGS/latency-$fmt.log" 2>&1; echo "latency $fmt rc=$?" >> "$LOGS/latency-$fmt.log"
done

cat > /tmp/w4a16_ncu.py <<'EOF'
import torch
from minillm.kernels.w4a16_gemv import w4a16_gemv
from minillm.kernels.w4a16_swap import w4a16_swap
for N, K in ((4096, 4096), (28672, 4096)):
    qw = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
    s = torch.rand(N, K // 128, device="cuda", dtype=torch.bfloat16) * 0.02
    m = -torch.rand(N, K // 128, device="cuda", dtype=torch.bfloat16) * 0.1
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        w4a16_gemv(x, qw, s, m, 128)
        w4a16_swap(x, qw, s, m, 128)
torch.cuda.synchronize()
EOF
has ncu && timeout 30 ncu -k regex:'w4a16_(gemv|swap)' --launch-skip 2 --launch-count 8 --metrics \
  gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active \
  python /tmp/w4a16_ncu.py > "$LOGS/ncu.log" 2>&1; echo "ncu rc=$?" >> "$LOGS/ncu.log"
# stalls: what the swap kernel's warps wait on (issue 25: half its issue slots idle, DRAM at a fifth of peak)
has stalls && timeout 90 ncu -k regex:'w4a16_swap' --launch-skip 2 --launch-count 2 --section WarpStateStats \
  --section SourceCounters --section SchedulerStats --section MemoryWorkloadAnalysis \
  python /tmp/w4a16_ncu.py > "$LOGS/ncu-stalls.log" 2>&1; echo "ncu stalls rc=$?" >> "$LOGS/ncu-stalls.log"
