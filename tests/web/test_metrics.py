"""web/metrics.py: the Prometheus exposition of one stats snapshot, without HTTP. vLLM's
series keep vLLM's names, types and model_name label; tailrace's own are prefixed; a new
stat shows up without a name of its own. (/metrics over HTTP: tests/web/test_app.py.)"""
from __future__ import annotations

import attrs
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.core.stats import EngineStats, Latencies, RequestShapes
from stages.account import Accountant
from stages.histogram import ITERATION_BUCKETS, PREEMPTION_BUCKETS, Histogram
from stages.delta import FinishReason
from web.metrics import EngineCollector


class StatsEngine:
    """What EngineCollector reads of the engine: its served names and a stats snapshot."""

    def __init__(self, stats: EngineStats) -> None:
        self.model_names = ["tiny", "alias"]
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def snapshot(acc: Accountant | None = None, **changes) -> EngineStats:
    """What Engine.stats() returns, from a real Accountant's counters and histograms."""
    a = acc or Accountant()
    stats = EngineStats(
        num_running=2, num_waiting=1, num_preemptions=3,
        kv_blocks_total=8, kv_blocks_free=6, kv_blocks_used=2, kv_blocks_cached=1,
        prompt_tokens_total=a.prompt_tokens_total, generation_tokens_total=a.generation_tokens_total,
        cached_tokens_total=a.cached_tokens_total,
        prefix_cache_queries_total=a.prefix_cache_queries_total,
        prefix_cache_hits_total=a.prefix_cache_hits_total,
        requests_finished_total=dict(a.finished_total), steps_total=40,
        num_waiting_by_reason={"capacity": 1, "deferred": 0},
        cache_config={"block_size": "16", "num_gpu_blocks": "8", "engine": "0"},
        latency=Latencies(ttft=a.ttft, itl=a.itl, e2e=a.e2e, queue=a.queue, prefill=a.prefill,
                          decode=a.decode, inference=a.inference),
        shapes=RequestShapes(prompt_tokens=a.request_prompt_tokens,
                             generation_tokens=a.request_generation_tokens,
                             params_n=a.request_params_n,
                             params_max_tokens=a.request_params_max_tokens,
                             num_preemptions=Histogram(PREEMPTION_BUCKETS),
                             iteration_tokens=Histogram(ITERATION_BUCKETS)))
    return attrs.evolve(stats, **changes)


def exposition(stats: EngineStats) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(StatsEngine(stats)))
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, parsed back as a scraper would."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


M = (("model_name", "tiny"),)     # the first served name, whichever alias a request used


@pytest.fixture
def acc() -> Accountant:
    a = Accountant()
    a.prompt_tokens_total, a.generation_tokens_total, a.cached_tokens_total = 30, 12, 16
    a.prefix_cache_queries_total, a.prefix_cache_hits_total = 30, 16
    a.finished_total = {FinishReason.STOP: 2, FinishReason.ABORT: 1}
    for v in (0.004, 0.05, 3.0):
        a.ttft.observe(v)
    a.e2e.observe(1.2)
    return a


def test_vllms_series_carry_vllms_names_and_the_model(acc):
    text = exposition(snapshot(acc))
    got = samples(text)
    assert got["vllm:num_requests_running", M] == 2
    assert got["vllm:num_requests_waiting", M] == 1
    assert got["vllm:num_preemptions_total", M] == 3
    assert got["vllm:prompt_tokens_total", M] == 30
    assert got["vllm:generation_tokens_total", M] == 12
    assert got["vllm:prefix_cache_queries_total", M] == 30
    assert got["vllm:prefix_cache_hits_total", M] == 16
    assert got["vllm:kv_cache_usage_perc", M] == 0.25
    kinds = types(text)
    assert kinds["vllm:num_requests_running"] == "gauge"
    assert kinds["vllm:prompt_tokens"] == kinds["vllm:num_preemptions"] == "counter"


def test_request_success_counts_finished_requests_only_every_reason_from_the_start(acc):
    got = samples(exposition(snapshot(acc)))
    success = {dict(labels)["finished_reason"]: v for (name, labels), v in got.items()
               if name == "vllm:request_success_total"}
    assert success == {"stop": 2, "length": 0, "tool_calls": 0}     # no abort, no error
    own = {dict(labels)["finished_reason"]: v for (name, labels), v in got.items()
           if name == "tailrace:requests_finished_total"}
    assert own == {"stop": 2, "length": 0, "abort": 1, "error": 0, "tool_calls": 0}


def test_latency_histograms_are_cumulative_with_sum_and_count(acc):
    got = samples(exposition(snapshot(acc)))
    name = "vllm:time_to_first_token_seconds"

    def bucket(le: str) -> float:
        return got[f"{name}_bucket", (("le", le), *M)]

    assert (bucket("0.001"), bucket("0.005"), bucket("0.06"), bucket("2.5"), bucket("5.0")) == (
        0, 1, 2, 2, 3)
    assert bucket("+Inf") == got[f"{name}_count", M] == 3
    assert got[f"{name}_sum", M] == pytest.approx(3.054)
    assert got["vllm:e2e_request_latency_seconds_count", M] == 1
    for hist in ("inter_token_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert got[f"vllm:{hist}_count", M] == 0                # exported while still empty


def test_tailraces_own_series(acc):
    text = exposition(snapshot(acc))
    got = samples(text)
    assert got["tailrace:kv_blocks_capacity", ()] == 8
    assert got["tailrace:kv_blocks_free", ()] == 6
    assert got["tailrace:kv_blocks_used", ()] == 2
    assert got["tailrace:kv_blocks_cached", ()] == 1
    assert got["tailrace:cached_tokens_total", ()] == 16
    assert got["tailrace:engine_steps_total", ()] == 40
    assert types(text)["tailrace:engine_steps"] == "counter"
    assert not any(name.startswith("tailrace:num_") for name, _ in got)   # vLLM's, not twice


def test_a_new_stat_shows_up_without_a_name_of_its_own():
    # a field added to EngineStats: stand-in, a subclass with the new fields
    extended = attrs.make_class("ExtendedStats", {
        "grammar_compiles_total": attrs.field(default=5), "grammar_cache_size": attrs.field(default=2.5),
        "by_kind": attrs.field(factory=lambda: {"json": 3, "regex": 1}),
        "label": attrs.field(default="ignored"), "flag": attrs.field(default=True),
        "mixed": attrs.field(factory=lambda: {"a": 1, "b": "x"})},
        bases=(EngineStats,), frozen=True, kw_only=True)
    got = samples(text := exposition(extended(**attrs.asdict(snapshot(), recurse=False))))
    assert got["tailrace:grammar_compiles_total", ()] == 5
    assert types(text)["tailrace:grammar_compiles"] == "counter"
    assert got["tailrace:grammar_cache_size", ()] == 2.5
    assert types(text)["tailrace:grammar_cache_size"] == "gauge"
    assert got["tailrace:by_kind", (("key", "json"),)] == 3
    assert got["tailrace:by_kind", (("key", "regex"),)] == 1
    names = {name for name, _ in got}
    assert not names & {"tailrace:label", "tailrace:flag", "tailrace:mixed"}   # not numbers


def test_an_empty_kv_cache_reports_no_usage_ratio():
    got = samples(exposition(snapshot(kv_blocks_total=0, kv_blocks_used=0)))
    assert ("vllm:kv_cache_usage_perc", M) not in got
    assert got["tailrace:kv_blocks_capacity", ()] == 0


def test_no_latency_histograms_before_the_engine_has_any():
    got = samples(exposition(EngineStats(num_running=1)))
    assert got[("vllm:num_requests_running", M)] == 1
    assert not any(name.endswith("_bucket") for name, _ in got)


def test_vllms_request_shape_series_and_info_gauges():
    from tests.support.rendered import rendered
    from stages.delta import Delta
    from stages.messages import Step

    acc = Accountant(max_model_len=100)
    req = rendered("r1", body={"n": 2}, max_tokens=7)
    acc.process(Step(0, (req,), (Delta("r1", (5,), index=0, scheduled_at=1.0),
                                 Delta("r1", (6,), index=1, scheduled_at=1.0)), done_at=2.0))
    acc.process(Step(1, (), (Delta("r1", (7,), FinishReason.STOP, index=0),
                             Delta("r1", (8,), FinishReason.LENGTH, index=1)), done_at=3.5))
    stats = snapshot(acc)
    stats.shapes.iteration_tokens.observe(24)
    stats.shapes.num_preemptions.observe(0)
    text = exposition(stats)
    got, kinds = samples(text), types(text)
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "request_num_preemptions",
                 "iteration_tokens_total", "request_inference_time_seconds"):
        assert kinds[f"vllm:{name}"] == "histogram", name
        assert got[f"vllm:{name}_count", M] == 1, name
    prompt = len(req.prompt_token_ids)
    assert got["vllm:request_prompt_tokens_sum", M] == prompt
    assert got["vllm:request_generation_tokens_sum", M] == 4      # both choices' tokens
    assert got["vllm:request_params_n_sum", M] == 2
    assert got["vllm:request_params_max_tokens_sum", M] == 7
    assert got["vllm:request_inference_time_seconds_sum", M] == pytest.approx(2.5)
    # vLLM's buckets, written as prometheus_client writes them
    assert got["vllm:request_params_n_bucket", (("le", "2.0"), *M)] == 1
    assert got["vllm:request_params_n_bucket", (("le", "1.0"), *M)] == 0
    assert ("vllm:request_prompt_tokens_bucket", (("le", "100.0"), *M)) in got
    assert ("vllm:request_prompt_tokens_bucket", (("le", "200.0"), *M)) not in got
    assert got["vllm:iteration_tokens_total_bucket", (("le", "32.0"), *M)] == 1
    assert got["vllm:iteration_tokens_total_bucket", (("le", "16.0"), *M)] == 0
    by_reason = {dict(labels)["reason"]: v for (name, labels), v in got.items()
                 if name == "vllm:num_requests_waiting_by_reason"}
    assert by_reason == {"capacity": 1, "deferred": 0}
    [(labels, value)] = [(dict(labels), v) for (name, labels), v in got.items()
                         if name == "vllm:cache_config_info"]
    assert value == 1 and labels == {"block_size": "16", "num_gpu_blocks": "8", "engine": "0"}
    assert not any(name.startswith("tailrace:cache_config") or "by_reason" in name
                   and name.startswith("tailrace:") for name, _ in got)
