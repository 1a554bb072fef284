"""Stop strings matched all at once (stop_strings.py; reliability probe round 4, M2 and S1).

The automaton agrees with the naive matcher (every stop string checked at every character) on random
texts cut into random tokens; its cost per character does not grow with the number of stop strings;
a Sequence stops where the naive matcher says; and SamplingParams caps the stop list (how many
strings, how many characters in all) with a ValueError naming `stop` and the limit."""

from __future__ import annotations

import random
import time

import pytest

from minillm import SamplingParams
from minillm.sampling.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from minillm.sequence import Sequence
from minillm.stop_strings import StopAutomaton, StopMatcher
from minillm.tokenizer import IncrementalDetokenizer


def _naive(stops: list[str], text: str, start: int) -> tuple[int, str] | None:
    """The first end position past `start` at which some stop ends; ties: the first in the list."""
    for end in range(start + 1, len(text) + 1):
        for stop in stops:
            if end >= len(stop) and text.startswith(stop, end - len(stop)):
                return end, stop
    return None


def _random_case(rng: random.Random):
    alphabet = rng.choice(["ab", "abc", "ab c.", "aé😀"])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    return stops, text


def test_the_automaton_agrees_with_the_naive_matcher_on_random_texts_and_tokens():
    rng = random.Random(1234)
    for _ in range(3000):
        stops, text = _random_case(rng)
        matcher, fed, expected = StopMatcher(stops), 0, None
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text)))) + [len(text)]
        got = None
        for cut in cuts:  # tokens of 0 to many characters
            hit = matcher.feed(text[:cut], fed)
            if hit is not None and got is None:
                got = hit
            if expected is None:
                expected = _naive(stops, text[:cut], fed)
            fed = cut
            if got is not None or expected is not None:
                break
        assert got == expected, (stops, text, cuts)


def test_one_character_tokens_find_what_str_find_per_stop_found():
    """With one character per token the old matcher (str.find per stop, in list order) and the new one
    cannot disagree: every match ends at the new character."""
    rng = random.Random(99)
    for _ in range(1000):
        stops, text = _random_case(rng)
        matcher, old, new = StopMatcher(stops), None, None
        for i in range(1, len(text) + 1):
            new = matcher.feed(text[:i], i - 1)
            for stop in stops:
                at = text[:i].find(stop, max(0, i - 1 - len(stop) + 1))
                if at >= 0:
                    old = (at + len(stop), stop)
                    break
            if old or new:
                break
        assert old == new, (stops, text)


def test_repeated_and_nested_stops():
    a = StopAutomaton(("abc", "bc", "abc", "c"))
    assert a.scan(0, "xabc", 0)[1:] == (4, 0)  # abc, bc and c end together: the first listed wins
    assert StopMatcher(["bc", "abcd"]).feed("abcd", 0) == (3, "bc")  # bc ends first
    assert StopMatcher(["zz"]).feed("abc", 0) is None


def test_the_cost_per_character_does_not_grow_with_the_number_of_stops():
    rng = random.Random(5)
    letters = "abcdefghijklmnopqrstuvwxyz"
    many = ["".join(rng.choice(letters) for _ in range(12)) for _ in range(5000)]
    text = "".join(rng.choice(letters + " ") for _ in range(20_000))

    def cost(stops) -> float:
        best = float("inf")
        for _ in range(3):
            m = StopMatcher(stops)  # built before the clock starts (and cached)
            t0 = time.perf_counter()
            for i in range(0, len(text), 4):  # 4 characters a token
                m.feed(text[: i + 4], i)
            best = min(best, time.perf_counter() - t0)
        return best

    one, lots = cost(many[:1]), cost(many)
    assert lots < 4 * one + 0.05, (one, lots)  # str.find per stop would be ~5000x


def _run(tok, ids: list[int], stops: list[str], include: bool = False) -> Sequence:
    seq = Sequence(0, [1], SamplingParams(stop=stops, max_tokens=10_000, include_stop_str_in_output=include),
                   0, tok, [], 100_000)
    for t in ids:
        seq.append(t)
        if seq.finished:
            break
    return seq


def test_a_sequence_stops_where_the_naive_matcher_says(tok):
    rng = random.Random(7)
    words = ["the", " cat", " sat", ".", " on", " mat", "\n", " a", "é", "😀"]
    for _ in range(150):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
        pieces = [detok.step(t) for t in ids]
        full = "".join(pieces)
        stops = [full[i : i + rng.randint(1, 6)] for i in sorted(rng.sample(range(len(full)), min(3, len(full))))]
        stops += ["".join(rng.choice("cat ") for _ in range(3))]
        rng.shuffle(stops)
        expected = _naive(stops, full, 0)
        include = rng.random() < 0.5
        seq = _run(tok, ids, stops, include)
        if expected is None:
            assert seq.finish_reason is None
            continue
        end, stop = expected
        tokens = next(k for k in range(1, len(ids) + 1) if len("".join(pieces[:k])) >= end)
        assert (seq.finish_reason, seq.stop_reason, len(seq.output_ids)) == ("stop", stop, tokens)
        assert seq.text == full[: end if include else end - len(stop)]


def test_a_sequence_step_costs_the_same_with_5000_stops_as_with_one(tok):
    """Through Sequence.append, the engine's per-token path (the cap keeps SamplingParams under 64
    stops; set past it here, as a list of that size used to be accepted): str.find per stop made a
    token cost 5000 finds (probe round 4, M2: a 3-token request beside one with 200k stops waited 16.7 s)."""
    rng = random.Random(11)
    ids = tok.encode(" ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(120)))
    many = ["".join(rng.choice("XYZ") for _ in range(12)) for _ in range(5000)]  # never in the text

    def cost(stops) -> float:
        best = float("inf")
        for _ in range(3):
            params = SamplingParams(stop=["XYZXYZ"], max_tokens=10_000)
            params.stop = stops
            seq = Sequence(0, [1], params, 0, tok, [], 100_000)  # the automaton is built here, off the clock
            t0 = time.perf_counter()
            for t in ids:
                seq.append(t)
            best = min(best, time.perf_counter() - t0)
            assert seq.finish_reason is None
        return best

    one, lots = cost(many[:1]), cost(many)
    assert lots < 4 * one + 0.02, (one, lots)


def test_min_tokens_hides_matches_before_it_but_keeps_reading(tok):
    ids = tok.encode("ab ab ab")  # "ab", " ab", " ab"
    seq = Sequence(0, [1], SamplingParams(stop=["ab"], min_tokens=2, max_tokens=100), 0, tok, [], 1000)
    seq.append(ids[0])
    assert seq.finish_reason is None  # a match before min_tokens does not count
    seq.append(ids[1])
    assert (seq.finish_reason, seq.text, len(seq.output_ids)) == ("stop", "ab ", 2)


def test_the_stop_list_is_capped():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["x" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=rf"stop holds {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=rf"stop strings hold {MAX_STOP_CHARS + 2} characters in all; at most "
                       rf"{MAX_STOP_CHARS}"):
        SamplingParams(stop=["x" * MAX_STOP_CHARS, "yy"])
