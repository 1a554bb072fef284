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


def test_ch03_checks_pass_the_reference_and_catch_mistakes():
    import torch

    from minillm.kernels.flash_decode import flash_decode_ref
    from minillm.labs import ch03
    from minillm.layers.attention import store_kv

    assert ch03.check_append_kv(lambda kc, vc, k, v, sm: store_kv(k, v, kc, vc, sm)).passed
    with pytest.raises(CheckFailed):  # K written, V forgotten
        ch03.check_append_kv(lambda kc, vc, k, v, sm: kc.view(-1, *kc.shape[2:]).index_copy_(0, sm, k))

    def inputs(seq_lens, slots, max_len, off=0):
        return (torch.tensor([n - 1 + off for n in seq_lens]),
                torch.tensor([s * max_len + n - 1 + off for s, n in zip(slots, seq_lens)]), torch.tensor(seq_lens))

    assert ch03.check_decode_inputs(inputs).passed
    with pytest.raises(CheckFailed):  # the new token put one past its position
        ch03.check_decode_inputs(lambda a, b, c: inputs(a, b, c, off=1))

    def decode(q, kc, vc, slots, seq_lens, whole_slot=False):
        lens = torch.full_like(seq_lens, kc.shape[1]) if whole_slot else seq_lens
        return flash_decode_ref(q, kc, vc, lens.int(), slots.int()[:, None])

    assert ch03.check_cached_decode_attention(decode).passed
    with pytest.raises(CheckFailed):  # attends over the whole slot, unwritten rows included
        ch03.check_cached_decode_attention(lambda *a: decode(*a, whole_slot=True))


def test_ch04_online_softmax_check_catches_a_missing_rescale():
    import torch

    from minillm.labs import ch04

    def step(m, l, acc, s, v, rescale=True):
        m_new = torch.maximum(m, s.amax(dim=1))
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_new[:, None])
        return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v

    assert ch04.check_online_softmax(step).passed
    with pytest.raises(CheckFailed):
        ch04.check_online_softmax(lambda *a: step(*a, rescale=False))
