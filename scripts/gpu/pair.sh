#!/usr/bin/env bash
# Two one-GPU jobs at once on a machine with two GPUs: job 0 sees only GPU 0, job 1 only GPU 1, each
# with its own $OUT folder. minillm (and the wheels in $WHEELS) is installed once first, and the jobs
# are told so (SKIP_INSTALL=1), so neither rewrites the package while the other imports it.
#   OUT=... WHEELS=.gpu/min bash scripts/gpu/pair.sh "job on GPU 0" "job on GPU 1"
# Timings of host-bound work can move a little while the other job shares the host's CPUs (16 cores a
# GPU here); the log records what ran beside what. Everything comes back as one archive, $OUT/pair.tgz.
set -uo pipefail
SITE=/tmp/minillm-site
out=${OUT:?}; mkdir -p "$out/gpu0" "$out/gpu1"
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1 SKIP_INSTALL=1
[ -z "${WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$WHEELS"/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target $SITE --upgrade .
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; date -u
  echo "commit ${COMMIT:-unknown}"; echo "GPU 0: $1"; echo "GPU 1: $2"; } | tee "$out/pair.txt"
CUDA_VISIBLE_DEVICES=0 OUT="$out/gpu0" bash -c "$1" > "$out/gpu0/job.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT="$out/gpu1" bash -c "$2" > "$out/gpu1/job.log" 2>&1 &
wait
tail -n 5 "$out"/gpu*/job.log
cd "$out" && tar czf /tmp/pair.tgz . && find . -type f -delete && mv /tmp/pair.tgz . && ls -la
