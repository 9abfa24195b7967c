"""Data parallel's pieces without a server (issue 36): the frontend's Balancer (which
engine a request goes to, and for how long it is remembered), the stats summed over the
engines, and /metrics' engine label."""
from __future__ import annotations

import math

import trio
from prometheus_client import CollectorRegistry, generate_latest

from pipeline.core.stats import EngineStats
from pipeline.layouts.frontend import Balancer, EngineLink, sum_engines
from pipeline.layouts.wire import Load
from stages.delta import Delta, FinishReason
from stages.messages import Step
from web.metrics import EngineCollector


def engines(n: int) -> list[EngineLink]:
    return [EngineLink(r, None, trio.open_memory_channel(math.inf)[0]) for r in range(n)]


def test_the_least_loaded_engine_is_picked_and_unreported_sends_count_as_waiting():
    es = engines(2)
    b = Balancer(es)
    es[0].report(Load(0, waiting=0, running=3, kv_usage=0.1))
    es[1].report(Load(1, waiting=1, running=0, kv_usage=0.0))
    assert b.pick("a", 1).rank == 0          # 3 < 4 x 1
    assert b.pick("b", 1).rank == 1          # engine 0: 3 + 4 (a, not reported yet) > 4
    assert (es[0].unreported, es[1].unreported) == (1, 1)
    es[0].report(Load(0, waiting=0, running=0, kv_usage=0.0))
    assert es[0].unreported == 0 and b.pick("c", 1).rank == 0


def test_ties_go_to_the_lower_kv_usage_then_in_turn():
    es = engines(3)
    b = Balancer(es)
    es[2].report(Load(2, 0, 0, 0.5))
    picks = []
    for i in range(6):
        e = b.pick(f"r{i}", 1)
        picks.append(e.rank)
        e.report(Load(e.rank, 0, 0, e.kv_usage))     # as if served at once
    assert 2 not in picks and set(picks) == {0, 1}


def test_a_pinned_rank_wins_and_a_request_is_forgotten_after_its_last_choice():
    es = engines(2)
    b = Balancer(es)
    es[1].report(Load(1, waiting=50, running=50, kv_usage=0.9))
    b.pinned["x"] = 1
    assert b.pick("x", 2).rank == 1 and b.of("x") is es[1] and "x" not in b.pinned
    one = Delta("x", (1,), FinishReason.LENGTH, index=0)
    b.finished(Step(1, (), (one,), 1, 0, 0, 0.0))
    assert b.of("x") is es[1]                 # choice 1 still runs
    b.finished(Step(2, (), (Delta("x", (2,), FinishReason.STOP, index=1),), 0, 0, 0, 0.0))
    assert b.of("x") is None


def test_one_engine_needs_no_bookkeeping():
    es = engines(1)
    b = Balancer(es)
    assert b.pick("a", 1) is es[0] and b.assigned == {} and b.of("anything") is es[0]


def test_the_server_stats_sum_the_engines_and_metrics_label_them():
    e0 = EngineStats(num_running=2, num_waiting=1, kv_blocks_total=10, kv_blocks_used=4,
                     steps_total=7, prompt_tokens_total=100, num_waiting_by_reason={"capacity": 1},
                     cache_config={"block_size": "16", "engine": "0"})
    e1 = EngineStats(num_running=3, num_waiting=0, kv_blocks_total=10, kv_blocks_used=1,
                     steps_total=5, num_waiting_by_reason={"capacity": 0},
                     cache_config={"block_size": "16", "engine": "1"})
    s = sum_engines([e0, e1])
    assert (s.num_running, s.num_waiting, s.kv_blocks_used, s.steps_total) == (5, 1, 5, 12)
    assert s.prompt_tokens_total == 100 and s.engines == (e0, e1)

    class Fake:
        model_names = ("m",)

        def stats(self):
            return s

    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(Fake()))
    text = generate_latest(reg).decode()
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 3.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4' in text
    assert 'tailrace:engine_steps_total{engine="0"} 7.0' in text
    assert 'vllm:cache_config_info{block_size="16",engine="1"} 1.0' in text
    assert 'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0' in text


def _scrape(stats: EngineStats) -> str:
    class Fake:
        model_names = ("m",)

        def stats(self):
            return stats

    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(Fake()))
    return generate_latest(reg).decode()


def test_every_metric_carries_the_engine_that_served_the_request():
    """-dp 2: each engine accounts for its own requests (the frontend's EngineAccounts,
    fed each engine's steps), so request_success_total, the token counters, the
    histograms and the speculative counters carry an `engine` label, as vLLM's; the
    server's figures are the engines' sums."""
    from pipeline.core.stats import AccountStats, CoreStats, SpecDecodeStats
    from stages.account import EngineAccounts
    from tests.support.rendered import rendered

    accounts = EngineAccounts(4096, 2)
    for engine, rid, prompt, tokens in ((0, "a", (1, 2, 3), (5, 6)), (1, "b", (1, 2), (7,))):
        req = rendered(rid, prompt)
        accounts.process(Step(0, (req,), (Delta(rid, tokens[:1], scheduled_at=0.5),),
                              done_at=1.0, engine=engine))
        accounts.process(Step(1, (), (Delta(rid, tokens[1:], FinishReason.STOP),),
                              done_at=2.0, engine=engine))
    spec = (SpecDecodeStats(num_drafts=3, num_draft_tokens=6, num_accepted_tokens=4,
                            accepted_per_pos=(3, 1)), SpecDecodeStats(num_drafts=1))
    from stages.histogram import Histogram
    per = [EngineStats.merge(CoreStats(steps_total=2, spec_decode=spec[k],
                                       request_preemptions=Histogram((1, 2)),
                                       iteration_tokens=Histogram((1, 8))),
                             [AccountStats.of(accounts.part(k))]) for k in (0, 1)]
    s = sum_engines(per)
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (5, 3)
    assert s.requests_finished_total == {"stop": 2} and s.latency.e2e.count == 2
    assert s.spec_decode.num_drafts == 4 and s.spec_decode.accepted_per_pos == (3, 1)
    text = _scrape(s)
    for line in ('vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0',
                 'vllm:request_success_total{engine="1",finished_reason="length",model_name="m"} 0.0',
                 'vllm:prompt_tokens_total{engine="0",model_name="m"} 3.0',
                 'vllm:prompt_tokens_total{engine="1",model_name="m"} 2.0',
                 'vllm:generation_tokens_total{engine="0",model_name="m"} 2.0',
                 'vllm:generation_tokens_total{engine="1",model_name="m"} 1.0',
                 'vllm:e2e_request_latency_seconds_count{engine="1",model_name="m"} 1.0',
                 'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0',
                 'vllm:request_prompt_tokens_sum{engine="1",model_name="m"} 2.0',
                 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 1.0',
                 'tailrace:requests_finished_total{engine="1",finished_reason="stop"} 1.0'):
        assert line in text, line
    # no series of one engine's figures is left without its label
    for line in text.splitlines():
        if line.startswith(("vllm:", "tailrace:")) and "_by_reason" not in line \
                and "max_loras" not in line:
            assert 'engine="' in line, line


def test_each_engine_gets_its_own_kv_connector_engine_id_and_side_channel_port(monkeypatch):
    import attrs

    monkeypatch.setenv("OMP_NUM_THREADS", "1")    # no share of this process's threads

    from pipeline.core.config import EngineConfig
    from stages.kv_transfer import KVTransferConfig
    from web.child import data_parallel_config

    kv = KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                                '"engine_id": "pd"}')
    cfg = EngineConfig(device="cpu", kv_transfer_config=attrs.evolve(kv, side_channel_port=5600))
    got = [data_parallel_config(cfg, 2, r).kv_transfer_config for r in (0, 1)]
    assert [(k.engine_id, k.side_channel_port) for k in got] == [("pd_dp0", 5600), ("pd_dp1", 5601)]
    any_port = attrs.evolve(cfg, kv_transfer_config=attrs.evolve(kv, side_channel_port=0))
    assert data_parallel_config(any_port, 2, 1).kv_transfer_config.side_channel_port == 0
    assert data_parallel_config(cfg, 1, 0) is cfg        # one engine: as given
