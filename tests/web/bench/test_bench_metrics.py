import pytest

from web.bench.account import RequestResult
from web.bench.metrics import (METRICS, TableOptions, detailed_fields, format_table, is_good, parse_goodput,
                               percentile_key, summarize)


def ok(ttft, itls, out, prompt=10, text="t"):
    latency = ttft + sum(itls)
    return RequestResult(True, prompt, out, ttft, latency, tuple(itls), text)


FAILED = RequestResult(False, 5, 0, 0.0, 0.0, (), "", error="HTTP 500: boom")


def test_summary_fields_and_values():
    results = [ok(0.1, [0.01, 0.03], 3), ok(0.3, [], 1), FAILED]
    s = summarize(results, 2.0, percentiles=(50, 99.9), goodput={"ttft": 200})
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 4
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 2.0 and s["total_token_throughput"] == 12.0
    assert s["request_goodput"] == 0.5
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx(20)  # only the 3-token request has a TPOT
    assert s["mean_itl_ms"] == pytest.approx(20) and s["p50_itl_ms"] == pytest.approx(20)
    assert s["mean_e2el_ms"] == pytest.approx((140 + 300) / 2)
    for m in METRICS:
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{m}_ms" in s


def test_no_goodput_field_without_slos_and_empty_results():
    s = summarize([FAILED], 1.0)
    assert "request_goodput" not in s
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0


def test_goodput_requires_every_slo():
    fast = ok(0.05, [0.01, 0.01], 3)
    slow_tail = ok(0.05, [0.2, 0.2], 3)
    assert is_good(fast, {"ttft": 100, "tpot": 50, "e2el": 100})
    assert not is_good(slow_tail, {"ttft": 100, "tpot": 50})
    assert is_good(slow_tail, {"ttft": 100})
    assert not is_good(slow_tail, {"e2el": 200})
    assert is_good(ok(0.05, [], 1), {"tpot": 1})  # no TPOT for one token
    assert not is_good(FAILED, {})
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:5000"]) == {"ttft": 200, "tpot": 50, "e2el": 5000}


def test_percentile_key():
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9" and percentile_key(50.0) == "p50"


def test_table_layout():
    s = summarize([ok(0.1, [0.01, 0.03], 3)], 2.0, percentiles=(90, 99), goodput={"e2el": 1000})
    table = format_table(s, TableOptions(("ttft", "e2el"), (90, 99)))
    lines = table.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert lines[-1] == "=" * 50
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "P90 TTFT (ms):", "P99 TTFT (ms):", "Mean E2EL (ms):", "P99 E2EL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    assert "TPOT" not in table and "ITL" not in table
    assert "Time to First Token".center(50, "-") in lines


def test_detailed_fields():
    d = detailed_fields([ok(0.1, [0.01], 2, text="ab"), FAILED])
    assert d == {"input_lens": [10, 5], "output_lens": [2, 0], "ttfts": [0.1, 0.0], "itls": [[0.01], []],
                 "e2els": [pytest.approx(0.11), 0.0], "generated_texts": ["ab", ""], "errors": ["", "HTTP 500: boom"]}
