#!/bin/bash
# Chapter 08 part A on the GPU (helper h2). Carry .gpu/h2 (the corpus text, 2.8 MB: the GPU machine has
# no network). From the repo root, two commands (each well under 10 minutes):
#   bash .gpu/h2/h2_quant.sh tests   # corpus/perplexity/AWQ/GPTQ/quantize tests, the slow embedded ones too
#   bash .gpu/h2/h2_quant.sh ppl     # the embedded SmolLM2's perplexity per weight format (JSON lines)
set -o pipefail
export MINILLM_CORPUS=$PWD/.gpu/h2/enwiki-gensim-4.4.0.txt PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT"
if [ "$1" = tests ]; then
  MINILLM_SLOW_QUANT=1 python -m pytest tests/test_corpus.py tests/test_perplexity.py tests/test_awq_gptq.py \
    tests/test_quantize_cli.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/h2_tests.log" | tail -15
  exit
fi
# 16,384 held-out tokens, windows of 1024 every 512, bf16; AWQ/GPTQ calibrate at load on 64 x 512 tokens of
# the calibration articles (the GPU default). Group 64 (and 32): SmolLM2's 576 inputs take no groups of 128.
for q in none int8 int4:group_size=64 awq:group_size=64 gptq:group_size=64 gptq:group_size=64,act_order=true \
         int4:group_size=32 awq:group_size=32 gptq:group_size=32,act_order=true; do
  start=$(date +%s)
  python -m minillm eval perplexity --quantization "$q" --max-tokens 16384 --context-len 1024 --stride 512 --json \
    2>>"$OUT/h2_ppl.err" | tee -a "$OUT/h2_ppl.jsonl"
  echo "$q: $(( $(date +%s) - start )) s with load and calibration" | tee -a "$OUT/h2_ppl_times.txt"
done
# save -> load through the CLI on the GPU: the loaded folder must give the same perplexity as awq:group_size=64
python -m minillm quantize --method awq --group-size 64 --out /tmp/h2-awq 2>>"$OUT/h2_ppl.err" && \
  python -m minillm eval perplexity --quantization /tmp/h2-awq --max-tokens 16384 --context-len 1024 --stride 512 \
    --json 2>>"$OUT/h2_ppl.err" | tee -a "$OUT/h2_ppl.jsonl"
python -m minillm generate "Name three rivers of Europe." --quantization /tmp/h2-awq --max-tokens 48 \
  2>&1 | tail -3 | tee "$OUT/h2_generate.txt"
