#!/usr/bin/env bash
# Chapter 09 (speculative decoding) on the GPU machine, after `.ci/gpu.sh setup .gpu`. One part per call
# (each under 10 minutes):
#   bash .gpu/h5_spec.sh tests     rejection sampler + spec engine oracle (CPU-sized models) and the
#                                  embedded model in fp32 on CUDA with graphs: spec tokens == plain tokens
#   bash .gpu/h5_spec.sh ngram     bench spec: plain vs ngram k=2,4,8, batch 1/8/64, grounded + open prompts
#   bash .gpu/h5_spec.sh skip      bench spec: layer_skip L'=8,16 k=2,4 and the embedded model as its own draft
#   bash .gpu/h5_spec.sh adaptive  bench spec: ngram k=4 with disable_by_batch_size=16 and min_acceptance_rate=0.3
#                                  at batch 1/16/64
#   (notebook 09 and lab 09: scripts/gpu/nb09.sh)
# Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h5-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    timeout 560 python3 -m pytest tests/test_rejection_sampler.py tests/test_spec_engine.py -q -p no:cacheprovider \
      -rs --durations=10 2>&1 | tail -40 | tee "$OUT/h5-tests.log" ;;
  ngram)
    timeout 570 python3 -m minillm bench spec --k 2 4 8 --draft-layers --batch-sizes 1 8 64 --max-tokens 128 \
      --json "$OUT/h5-spec-ngram.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/h5-spec-ngram.log" ;;
  skip)
    DRAFT=$(python3 -c "from minillm.model_files import embedded_model_path; print(embedded_model_path())")
    timeout 570 python3 -m minillm bench spec --k 2 4 --draft-layers 8 16 --draft-model "$DRAFT" --batch-sizes 1 8 \
      --max-tokens 96 --json "$OUT/h5-spec-skip.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/h5-spec-skip.log" ;;
  adaptive)
    timeout 570 python3 -m minillm bench spec --k 4 --draft-layers --batch-sizes 1 16 64 --max-tokens 128 \
      --disable-by-batch-size 16 --min-acceptance-rate 0.3 --json "$OUT/h5-spec-adaptive.json" 2>&1 | grep -v "it/s\]" \
      | tee "$OUT/h5-spec-adaptive.log" ;;
  *) echo "usage: $0 tests|ngram|skip|adaptive"; exit 2 ;;
esac
