"""EngineStats.merge: the engine core's gauges and every request side's accounting, one
snapshot (pipeline/core/stats.py). The same merge serves one process (one request side)
and --api-server-count (one per frontend)."""
from __future__ import annotations

import pickle

import pytest

from pipeline.core.stats import AccountStats, CoreStats, EngineStats, SpecDecodeStats
from stages.account import Accountant
from stages.histogram import ITERATION_BUCKETS, PREEMPTION_BUCKETS, Histogram
from stages.delta import FinishReason


def _accountant(prompt: int, ttfts: list[float], finished: dict) -> Accountant:
    a = Accountant(max_model_len=64)
    a.prompt_tokens_total = prompt
    a.generation_tokens_total = 2 * prompt
    a.cached_tokens_total = 1
    for v in ttfts:
        a.ttft.observe(v)
        a.request_prompt_tokens.observe(prompt)
    a.finished_total.update(finished)
    return a


def _core() -> CoreStats:
    pre, it = Histogram(PREEMPTION_BUCKETS), Histogram(ITERATION_BUCKETS)
    it.observe(24)
    return CoreStats(num_running=3, num_waiting=1, num_waiting_by_reason={"capacity": 1},
                     kv_blocks_total=10, kv_blocks_used=4, steps_total=9,
                     cache_config={"block_size": "16"}, request_preemptions=pre,
                     iteration_tokens=it, spec_decode=SpecDecodeStats(num_drafts=2))


def test_two_request_sides_add_up_counter_by_counter_and_bucket_by_bucket():
    a = AccountStats.of(_accountant(5, [0.002, 0.3], {FinishReason.STOP: 2}))
    b = AccountStats.of(_accountant(7, [0.3], {FinishReason.STOP: 1, FinishReason.ABORT: 1}))
    s = EngineStats.merge(_core(), [a, b])
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.cached_tokens_total) == (12, 24, 2)
    assert s.requests_finished_total == {"stop": 3, "abort": 1}
    assert s.latency.ttft.count == 3 and s.latency.ttft.sum == pytest.approx(0.602)
    assert s.latency.ttft.counts == [x + y for x, y in zip(a.latency.ttft.counts,
                                                           b.latency.ttft.counts)]
    assert s.shapes.prompt_tokens.sum == 5 * 2 + 7
    # the core's own numbers pass through as they are
    assert (s.num_running, s.kv_blocks_used, s.steps_total) == (3, 4, 9)
    assert s.shapes.iteration_tokens.count == 1 and s.spec_decode.num_drafts == 2


def test_one_request_side_is_what_one_process_reports_and_nothing_is_shared():
    acc = _accountant(5, [0.01], {FinishReason.LENGTH: 1})
    s = EngineStats.merge(_core(), [AccountStats.of(acc)])
    assert s.prompt_tokens_total == 5 and s.requests_finished_total == {"length": 1}
    acc.ttft.observe(1.0)                  # the snapshot is a sum, not the live histogram
    assert s.latency.ttft.count == 1


def test_no_request_side_means_no_latencies_and_an_account_crosses_the_wire():
    s = EngineStats.merge(_core(), [])
    assert s.latency is None and s.shapes is None and s.prompt_tokens_total == 0
    a = AccountStats.of(_accountant(5, [0.01], {}))
    assert pickle.loads(pickle.dumps(a)).latency.ttft.counts == a.latency.ttft.counts


def test_histograms_with_different_buckets_do_not_add_up():
    with pytest.raises(ValueError, match="different buckets"):
        Histogram.summed([Histogram((1, 2)), Histogram((1, 3))])
