"""`minillm bench serve`: the metric arithmetic on hand-made timestamps (a wrong formula fails), the
arrival process, the SSE parser, and the client against the real `minillm serve` on 127.0.0.1."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys

import pytest

from minillm.bench.serve_metrics import (
    RequestResult,
    SSEParser,
    arrival_times,
    describe,
    e2e,
    goodput,
    itl,
    parse_slo,
    parse_sse,
    summarize,
    tpot,
    ttft,
)

# ---- metrics on hand-made timestamps -------------------------------------------------------------

# sent at 10.0; text chunks at these times; the server said 7 tokens (the last chunk held four)
START, CHUNKS, TOKENS = 10.0, [10.5, 10.625, 10.75, 11.125], 7


def test_request_metrics_by_hand():
    assert ttft(START, CHUNKS) == pytest.approx(0.5)
    assert e2e(START, CHUNKS) == pytest.approx(1.125)
    assert itl(CHUNKS) == pytest.approx([0.125, 0.125, 0.375])
    # (E2E - TTFT) / (n - 1) over tokens, not chunks: 0.625 / 6
    assert tpot(START, CHUNKS, TOKENS) == pytest.approx(0.625 / 6)
    assert tpot(START, [10.5], 1) is None  # one token: no TPOT
    with pytest.raises(ValueError, match="no chunk"):
        ttft(START, [])


def test_describe_percentiles_by_hand():
    d = describe([0.001, 0.002, 0.003, 0.004], "x")  # seconds -> ms, linear interpolation
    assert d == pytest.approx({"mean_x_ms": 2.5, "median_x_ms": 2.5, "p50_x_ms": 2.5, "p90_x_ms": 3.7,
                               "p99_x_ms": 3.97})
    assert all(math.isnan(v) for v in describe([], "x").values())


def test_summary_and_goodput_by_hand():
    fast = RequestResult(0.0, [0.1, 0.2, 0.3], output_tokens=3, prompt_tokens=5, success=True)  # TTFT 100, TPOT 100
    slow_first = RequestResult(1.0, [1.9, 2.0], output_tokens=2, prompt_tokens=4, success=True)  # TTFT 900, TPOT 100
    no_usage = RequestResult(2.0, [2.05, 2.5], output_tokens=None, prompt_tokens=6, success=True)  # 2 chunks: 2 tokens
    one_token = RequestResult(3.0, [3.2], output_tokens=1, prompt_tokens=1, success=True)  # TPOT counts as 0
    failed = RequestResult(4.0, [], success=False, error="HTTP 500")
    results = [fast, slow_first, no_usage, one_token, failed]
    s = summarize(results, duration=5.0, slo=(500, 150))
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_output_tokens"] == 3 + 2 + 2 + 1 and s["total_input_tokens"] == 16
    assert s["output_throughput"] == pytest.approx(8 / 5) and s["request_throughput"] == pytest.approx(4 / 5)
    assert s["total_token_throughput"] == pytest.approx(24 / 5)
    assert s["mean_ttft_ms"] == pytest.approx((100 + 900 + 50 + 200) / 4)
    assert s["mean_tpot_ms"] == pytest.approx((100 + 100 + 450) / 3)  # the one-token request has none
    assert s["mean_e2el_ms"] == pytest.approx((300 + 1000 + 500 + 200) / 4)
    assert s["mean_itl_ms"] == pytest.approx((100 + 100 + 100 + 450) / 4)
    # SLO 500 ms TTFT, 150 ms TPOT: fast and one_token meet both; slow_first misses TTFT, no_usage TPOT
    assert s["goodput"] == pytest.approx(2 / 5) == goodput(results, (500, 150), 5.0)
    assert goodput(results, (1000, 500), 5.0) == pytest.approx(4 / 5)
    assert s["tpot_unmeasured"] == 0
    # a whole 5-token answer in one chunk: no time between tokens was seen, so no TPOT (not 0), counted
    one_chunk = RequestResult(5.0, [5.3], output_tokens=5, prompt_tokens=2, success=True)
    s2 = summarize([fast, one_chunk], duration=5.0)
    assert s2["tpot_unmeasured"] == 1 and s2["mean_tpot_ms"] == pytest.approx(100)
    assert s2["total_output_tokens"] == 8 and s2["mean_ttft_ms"] == pytest.approx((100 + 300) / 2)


def test_parse_slo():
    assert parse_slo("500,50") == (500.0, 50.0) and parse_slo(None) is None
    for bad in ["500", "a,b", "0,5", "5,-1", "1,2,3", "inf,5"]:
        with pytest.raises(ValueError, match="ttft_ms,tpot_ms"):
            parse_slo(bad)


# ---- arrivals -------------------------------------------------------------------------------------

def test_arrival_times():
    assert arrival_times(5, math.inf) == [0.0] * 5
    for burstiness, cv in [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)]:  # Gamma(k): coefficient of variation 1/sqrt(k)
        times = arrival_times(4000, 50.0, burstiness, seed=1)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert times[0] == 0 and all(g >= 0 for g in gaps)
        assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)
    assert arrival_times(10, 3.0, seed=2) == arrival_times(10, 3.0, seed=2) != arrival_times(10, 3.0, seed=3)
    for rate, burst in [(0, 1), (-1, 1), (math.nan, 1), (1, 0), (1, math.inf)]:
        with pytest.raises(ValueError, match="request_rate|burstiness"):
            arrival_times(3, rate, burst)


# ---- SSE ------------------------------------------------------------------------------------------

def test_sse_by_hand():
    stream = (b": a comment\r\ndata: {\"a\": 1}\r\n\r\ndata:no space\n\ndata: two\rdata: lines\r\r"
              b"event: ping\nid: 3\n\ndata\n\ndata:  kept space\n\ndata: caf\xc3\xa9\n\ndata: [DONE]\n\ndata: cut")
    want = ['{"a": 1}', "no space", "two\nlines", "", " kept space", "café", "[DONE]"]
    assert parse_sse([stream]) == want
    assert parse_sse([stream[i:i + 1] for i in range(len(stream))]) == want  # cut between every byte
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == [] and parser.feed(b"\n\r\n") == ["x"]  # a CRLF cut in two


def test_sse_random_cuts():
    rng = random.Random(0)
    for _ in range(50):
        events = ["".join(rng.choice("ab é{}:\"") for _ in range(rng.randint(0, 12))) for _ in range(rng.randint(1, 6))]
        eol = rng.choice(["\n", "\r\n", "\r"])
        data = "".join(f"data: {e}{eol}{eol}" for e in events).encode()
        cuts = sorted(rng.sample(range(1, len(data)), min(5, len(data) - 1)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        assert parse_sse(pieces) == events


# ---- against the real server ----------------------------------------------------------------------

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    from serve_utils import serve

    with serve(tiny_chat_model, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.mark.slow
def test_random_workload_against_minillm(server, tiny_chat_model):
    from serve_utils import total

    from minillm.bench.serve import run

    before = server.wait_idle()
    out = run(server.base, workload="random", num_prompts=6, min_input_len=4, max_input_len=12, min_output_len=3,
              max_output_len=9, tokenizer=str(tiny_chat_model), prompt_format="ids", ignore_eos=True,
              request_rate=50.0, max_concurrency=4, slo="100000,100000", no_progress=True)
    after = server.wait_idle()
    assert (out["completed"], out["failed"]) == (6, 0)
    # the server's own counts (minus the untimed probe request) equal what the client counted
    assert total(after, "minillm_requests_total") - total(before, "minillm_requests_total") == 7
    generated = total(after, "minillm_generation_tokens_total") - total(before, "minillm_generation_tokens_total")
    prompts = total(after, "minillm_prompt_tokens_total") - total(before, "minillm_prompt_tokens_total")
    assert out["total_output_tokens"] == generated - min(8, _first_output_len(tiny_chat_model))
    assert out["total_input_tokens"] == prompts - _first_prompt_len(tiny_chat_model)
    assert out["goodput"] == pytest.approx(out["request_throughput"])  # a generous SLO: every request good
    assert 0 < out["median_ttft_ms"] <= out["median_e2el_ms"] and out["p99_ttft_ms"] >= out["p50_ttft_ms"]
    assert out["mean_tpot_ms"] > 0


def _first_request(model):
    from minillm.bench.serve import random_workload

    return random_workload(6, (4, 12), (3, 9), 0, str(model), "ids")[0]


def _first_output_len(model):
    return _first_request(model).max_tokens


def _first_prompt_len(model):
    return _first_request(model).prompt_len


def test_cli_chat_prompts_workload(server, tmp_path):
    """`minillm bench serve` as a user runs it: chat endpoint, real prompts, JSON out."""
    out_json = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "minillm", "bench", "serve", "--base-url", server.base, "--endpoint", "chat",
           "--workload", "prompts", "--num-prompts", "5", "--max-tokens", "6", "--request-rate", "inf",
           "--slo", "60000,60000", "--output-json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out_json.read_text())
    assert result["completed"] == 5 and result["failed"] == 0 and result["request_rate"] == "inf"
    assert 5 <= result["total_output_tokens"] <= 30 and result["total_input_tokens"] > 0
    assert "serving benchmark" in proc.stdout and "median_ttft_ms" in proc.stdout


def test_bad_arguments_and_dead_server():
    from minillm.bench.serve import ServerError, run

    with pytest.raises(ValueError, match="request_rate"):
        run("http://127.0.0.1:9", request_rate=0, num_prompts=1)
    with pytest.raises(ValueError, match="ttft_ms,tpot_ms"):
        run("http://127.0.0.1:9", slo="fast", num_prompts=1)
    with pytest.raises(ValueError, match="num_prompts"):
        run("http://127.0.0.1:9", num_prompts=0)
    from serve_utils import free_port

    with pytest.raises(ServerError, match="did not answer a test request"):
        run(f"http://127.0.0.1:{free_port()}", workload="prompts", num_prompts=1, max_tokens=2, model="m",
            no_progress=True)


# ---- lab 12's checks: the solution passes, the classic slips fail ---------------------------------

def _lab12():
    import jupytext

    from minillm.labs import ch12

    ns: dict = {}
    path = __import__("pathlib").Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "12_serving.py"
    for cell in jupytext.read(path).cells:
        if cell.cell_type == "code" and "check" not in cell.metadata.get("tags", []):
            exec(compile(cell.source, path.name, "exec"), ns)
    return ch12, ns


def test_lab12_checks_pass_the_solution_and_catch_slips():
    from minillm.labs import CheckFailed

    ch12, lab = _lab12()
    assert ch12.check_request_metrics(lab["request_metrics"]).passed
    assert ch12.check_goodput(lab["goodput"]).passed
    assert ch12.check_parse_sse(lab["parse_sse"]).passed
    metrics = lab["request_metrics"]

    def over_n(start, times, n):  # TPOT over all n tokens
        ttft_, tpot_, itl_, e2e_ = metrics(start, times, n)
        n = len(times) if n is None else n
        return ttft_, None if tpot_ is None else tpot_ * (n - 1) / n, itl_, e2e_

    def per_chunk(start, times, n):  # TPOT over chunks, ignoring the usage
        return metrics(start, times, None)

    def throughput(requests, slo, duration):  # every successful request counted, SLOs or not
        return sum(ok for *_, ok in requests) / duration

    def sse(chunks, strip=True, eol=r"\r\n|\r|\n", keep_last=False):
        import re

        events, data = [], []
        lines = re.split(eol, b"".join(chunks).decode())
        for line in lines if keep_last else lines[:-1]:
            if line == "":
                events += ["\n".join(data)] if data else []
                data = []
            elif line == "data" or line.startswith("data:"):
                data.append(line[5:].removeprefix(" ") if strip else line[5:])
        return events + (["\n".join(data)] if keep_last and data else [])

    assert ch12.check_parse_sse(sse).passed
    sse_slips = [lambda c: sse(c, strip=False), lambda c: sse(c, eol=r"\r?\n"), lambda c: sse(c, keep_last=True)]
    for check, slip in [(ch12.check_request_metrics, over_n), (ch12.check_request_metrics, per_chunk),
                        (ch12.check_goodput, throughput)] + [(ch12.check_parse_sse, slip) for slip in sse_slips]:
        with pytest.raises(CheckFailed):
            check(slip)
