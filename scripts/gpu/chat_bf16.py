"""Issue 24 item 4: is greedy chat in bf16 batch-dependent? The engine alone, no server.

One conversation, greedy, answered by LLM.chat alone and again inside a batch of other conversations,
in bf16 and in fp32. If the two bf16 answers part while the fp32 ones agree, the difference the
server holdout saw is batch-dependent numerics (other batch sizes pick other GEMM tiles and attention
splits, whose bf16 rounding differs), not a different prompt: at the first token where they part the
script prints the top-2 logit margin at that step, alone, which is a near-tie when numerics decide.

    python3 -P scripts/gpu/chat_bf16.py [--json OUT.json]     (the embedded model; a GPU for bf16)
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from minillm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]
TOPICS = ["tides", "rainbows", "volcanoes", "glaciers", "auroras", "earthquakes", "comets", "deserts",
          "coral reefs", "thunder", "fog", "monsoons", "geysers", "eclipses", "snowflakes"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def margin_at(llm: LLM, prompt_ids: list[int], answer: list[int], i: int) -> float:
    """Top-1 minus top-2 logit at answer position i, the request alone (logprobs of the top 2)."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt_ids + answer[:i]}, params, use_tqdm=False)[0].outputs[0]
    top = sorted((lp.logprob for lp in out.logprobs[0].values()), reverse=True)
    return top[0] - top[1]  # logprob difference = logit difference


def run(dtype: str, device: str, batch: int, max_tokens: int) -> dict:
    llm = LLM(device=device, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    [alone] = llm.chat(QUESTION, params, use_tqdm=False)
    others = [[{"role": "user", "content": f"Tell me about {t}."}] for t in random.Random(0).sample(TOPICS, batch - 1)]
    batched = llm.chat(others[: batch // 2] + [QUESTION] + others[batch // 2:], params, use_tqdm=False)[batch // 2]
    a, b = alone.outputs[0].token_ids, batched.outputs[0].token_ids
    assert alone.prompt_token_ids == batched.prompt_token_ids  # the same prompt either way
    i = first_difference(a, b)
    row = {"dtype": dtype, "batch": batch, "tokens": len(a), "first_difference": i, "equal": i is None}
    if i is not None and i < len(a):
        row["top2_margin_alone_at_difference"] = margin_at(llm, alone.prompt_token_ids, a, i)
    llm.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [run(dt, device, a.batch, a.max_tokens) for dt in (["bfloat16", "float32"] if device == "cuda" else ["float32"])]
    for r in rows:
        print(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
