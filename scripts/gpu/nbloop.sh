#!/usr/bin/env bash
# Notebooks in turn under one time budget, each under what is left of it (a job for pair.sh):
#   OUT=/some/dir BUDGET_S=500 bash scripts/gpu/nbloop.sh 03 13 02
# Each executed notebook is copied to $OUT as soon as it ends (also when it failed or ran out of time:
# nbrun keeps the cells that ran), so a call cut short still brings back every finished one.
# Pass COMMIT=<short hash of the tree sent>: the notebooks' headers record it ($MINILLM_COMMIT). Without it they
# record what `git rev-parse` finds on the GPU machine, which need not be the tree that ran.
set -uo pipefail
[ -z "${COMMIT:-}" ] || export MINILLM_COMMIT=$COMMIT
out=${OUT:?}; end=$(( $(date +%s) + ${BUDGET_S:-500} ))
for n in "$@"; do
  nb=$(ls notebooks/"${n}"_*.ipynb 2>/dev/null | head -1)
  [ -n "$nb" ] || { echo "no notebook $n"; continue; }
  left=$(( end - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "== $nb: not run ($left s of the budget left)"; continue; fi
  echo "== $nb ($left s left) $(date -u +%T)"
  t0=$(date +%s)
  timeout "$left" python3 -m minillm.nbrun "$nb" 2>&1 | grep -v IPKernelApp | tail -n 60
  echo "== $nb rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"
  cp "$nb" "$out/"
done
