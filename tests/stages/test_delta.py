"""The one delta shape: the event log's converter round-trips a Step's deltas, FinishReason
included (requests are covered by the engine's replay test)."""
import orjson

from gpu.interface import TokenLogprobs
from pipeline.core.events import structure_step, unstructure
from stages.lib.delta import Delta, FinishReason, TokenLogprob, Usage
from stages.messages import Step


def test_step_round_trips_through_the_event_log_converter():
    step = Step(3, (), (
        Delta("a", (5,), FinishReason.STOP, 7, 2,
              token_logprobs=(TokenLogprobs(-0.5, (5, 6), (-0.5, -1.5)),)),
        Delta("b", finish_reason=FinishReason.ERROR, error="boom"),
        Delta("c", (9,), FinishReason.STOP, "</s>", text="x", content="x",
              logprobs=(TokenLogprob("x", -0.1, (("y", -2.0),)),), usage=Usage(2, 1)),
        Delta("d", (1,))), num_running=1, num_waiting=2, kv_blocks_used=3)
    back = structure_step(orjson.loads(orjson.dumps(unstructure(step))))
    assert back == step
    assert type(back.deltas[0].finish_reason) is FinishReason
    assert back.deltas[0].stop_reason == 7 and back.deltas[2].stop_reason == "</s>"
    assert orjson.dumps(unstructure(step)).count(b'"finish_reason":"stop"') == 2


# -- account: timings ---------------------------------------------------------------------

def test_account_timings_histograms_and_per_request_metrics():
    import attrs as _attrs
    from rendered import rendered
    from stages.account import Accountant

    req = _attrs.evolve(rendered("a", (1, 2, 3, 4)), arrival=10.0, per_request_metrics=True)
    other = _attrs.evolve(rendered("b", (1, 2)), arrival=10.0)
    acc = Accountant()

    def step(n, done_at, *deltas):
        out, _ = acc.process(Step(n, (req, other) if n == 1 else (), tuple(deltas),
                                  done_at=done_at))
        return {d.request_id: d for d in out.deltas}

    # a: queued at 10.0, scheduled at 10.5, tokens back at 11.0, 11.2, 11.6 (then finished)
    step(1, 11.0, Delta("a", (7,), scheduled_at=10.5, num_cached_tokens=2))
    step(2, 11.2, Delta("a", (8,), scheduled_at=10.5))
    out = step(3, 11.6, Delta("a", (9,), FinishReason.LENGTH, scheduled_at=10.5),
               Delta("b", (), FinishReason.ABORT))
    m = out["a"].metrics
    assert m.queue_time_ms == 500.0 and m.time_to_first_token_ms == 500.0
    assert m.generation_time_ms == 600.0 and m.mean_itl_ms == 300.0
    assert m.tokens_per_second == round(3 / 1.1, 3)
    assert out["b"].metrics is None                     # not asked for (and aborted)
    assert acc.ttft.count == 1 and acc.ttft.sum == 1.0  # 10.0 -> 11.0
    assert acc.itl.count == 2 and round(acc.itl.sum, 6) == 0.6
    assert acc.e2e.count == 1 and round(acc.e2e.sum, 6) == 1.6   # aborts are not observed
    assert (acc.queue.sum, acc.prefill.sum, round(acc.decode.sum, 6)) == (0.5, 0.5, 0.6)
    assert (acc.prefix_cache_queries_total, acc.prefix_cache_hits_total) == (4, 2)
    cumulative = dict(acc.ttft.cumulative())
    assert cumulative["0.5"] == 0 and cumulative["1.0"] == 1 and cumulative["+Inf"] == 1
