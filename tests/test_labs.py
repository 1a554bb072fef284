"""The lab checks bite at the function level: minillm's own answer passes, plausible wrong answers
fail with a message naming the input. (test_lab_notebooks.py proves it for the notebooks.)"""

from __future__ import annotations

from collections import Counter

import pytest

from minillm.hw import matmul_cost
from minillm.kv_memory import kv_cache_bytes
from minillm.labs import CheckFailed, ch00, ch01
from minillm.labs.checker import SKIPPED_HARDWARE, requires_gpu
from minillm.tokenizer import bpe, count_pairs, load_tokenizer, merge_pair


def test_ch00_checks_pass_the_reference_and_catch_mistakes():
    assert ch00.check_matmul_cost(matmul_cost).passed
    with pytest.raises(CheckFailed, match="matmul_cost"):
        ch00.check_matmul_cost(lambda m, n, k, b: (m * n * k, (m * k + k * n + m * n) * b))  # forgot the 2
    with pytest.raises(CheckFailed):
        ch00.check_matmul_cost(lambda m, n, k, b: (2 * m * n * k, (m * k + k * n) * b))  # forgot writing C
    assert ch00.check_kv_cache_bytes(kv_cache_bytes).passed
    with pytest.raises(CheckFailed):
        ch00.check_kv_cache_bytes(lambda L, h, d, t, b, s: L * h * d * t * b * s)  # forgot K *and* V
    assert ch00.check_attainable(lambda i, p, bw: min(p, i * bw / 1e3)).passed
    with pytest.raises(CheckFailed):
        ch00.check_attainable(lambda i, p, bw: min(p, i * bw))  # units: GB/s * FLOP/B is GFLOP/s


def test_ch01_checks_pass_the_reference_and_catch_mistakes():
    assert ch01.check_count_pairs(count_pairs).passed
    with pytest.raises(CheckFailed):
        ch01.check_count_pairs(lambda words: Counter(p for w in words for p in zip(w, w[1:])))  # unweighted
    assert ch01.check_merge_pair(merge_pair).passed

    def first_only(ids, pair, new):  # a classic slip: replaces only the first occurrence
        for i in range(len(ids) - 1):
            if (ids[i], ids[i + 1]) == pair:
                return ids[:i] + [new] + ids[i + 2:]
        return list(ids)

    with pytest.raises(CheckFailed):
        ch01.check_merge_pair(first_only)
    assert ch01.check_bpe(bpe).passed

    def highest_rank_first(ids, merges):
        while len(ids) > 1:
            cands = [(merges[p][0], p) for p in zip(ids, ids[1:]) if p in merges]
            if not cands:
                break
            _, p = max(cands)
            ids = merge_pair(ids, p, merges[p][1])
        return ids

    with pytest.raises(CheckFailed):
        ch01.check_bpe(highest_rank_first)
    tok = load_tokenizer()
    assert ch01.check_encode(tok.encode).passed
    with pytest.raises(CheckFailed):
        ch01.check_encode(lambda text: [i for w in text.split(" ") for i in tok.encode(w)])  # loses spaces


def test_stub_raises_through_the_check():
    def stub(*args):
        raise NotImplementedError("your code here")

    with pytest.raises(NotImplementedError):
        ch00.check_matmul_cost(stub)


def test_gpu_checks_say_skipped_on_cpu(capsys):
    import torch

    verdict = requires_gpu("needs_gpu")
    if torch.cuda.is_available():
        assert verdict is None
    else:
        assert verdict.status == SKIPPED_HARDWARE and not verdict.passed
        assert "not counted as passed" in capsys.readouterr().out
