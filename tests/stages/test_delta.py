"""The one delta shape: the event log's converter round-trips a Step's deltas, FinishReason
included (requests are covered by the engine's replay test)."""
import orjson

from gpu.interface import TokenLogprobs
from pipeline.core.events import structure_step, unstructure
from stages.delta import Delta, FinishReason, TokenLogprob, Usage
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
    from tests.support.rendered import rendered
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


# -- building a Delta: the constructor and each stage's builder -----------------------------

def _every_field_set(**over):
    """A Delta whose every field differs from its default (and from every other Delta's
    this makes with other `over`)."""
    import attrs
    from stages.delta import PromptLogprob, RequestMetrics, ToolCallDelta
    values = dict(request_id="r", token_ids=(1, 2), finish_reason=FinishReason.LENGTH,
                  stop_reason=9, num_cached_tokens=3, error="e",
                  token_logprobs=(TokenLogprobs(-1.0, (1,), (-1.0,)),), scheduled_at=4.0,
                  index=5, prompt_token_logprobs=(None,), draft_tokens=6, accepted_tokens=7,
                  text="t", logprobs=(TokenLogprob("t", -1.0),),
                  prompt_logprobs=(PromptLogprob(1, "p", None),), content="c", reasoning="z",
                  tool_calls=(ToolCallDelta(0, "id", "f", "{}"),), reasoning_tokens=8,
                  reasoning_span=9, usage=Usage(1, 2), metrics=RequestMetrics(1, 2, 3, 4, 5),
                  pooled=b"\x00\x00\x80?", kv_transfer_params={"remote_request_id": "r"})
    assert set(values) == {a.name for a in attrs.fields(Delta)}
    return Delta(**{**values, **over})


def test_delta_init_is_its_fields_in_order_with_their_defaults():
    import inspect

    import attrs
    params = list(inspect.signature(Delta.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == [
        (a.name, inspect.Parameter.empty if a.default is attrs.NOTHING else a.default)
        for a in attrs.fields(Delta)]
    d = _every_field_set()
    assert attrs.evolve(d) == d and vars(d) == attrs.asdict(d, recurse=False)
    try:
        d.text = "x"
    except attrs.exceptions.FrozenInstanceError:
        pass
    else:
        raise AssertionError("Delta is not frozen")


def test_each_stage_builder_sets_its_fields_and_carries_every_other():
    import attrs
    from stages.delta import RequestMetrics
    d = _every_field_set()
    lp, plp = (TokenLogprob("u", -2.0),), ()
    cases = [
        (d.detokenized("T", lp, None, None, (1,), (), plp),
         dict(text="T", content="T", logprobs=lp, finish_reason=None, stop_reason=None,
              token_ids=(1,), token_logprobs=(), prompt_logprobs=plp)),
        (d.parsed("C", "R", (), FinishReason.TOOL_CALLS, 1, 2),
         dict(content="C", reasoning="R", tool_calls=(), finish_reason=FinishReason.TOOL_CALLS,
              reasoning_tokens=1, reasoning_span=2)),
        (d.accounted(Usage(5, 6), RequestMetrics(0, 0, 0, 0, 0)),
         dict(usage=Usage(5, 6), metrics=RequestMetrics(0, 0, 0, 0, 0))),
        (d.accounted(Usage(5, 6)), dict(usage=Usage(5, 6), metrics=None)),
    ]
    for built, changed in cases:
        assert built == attrs.evolve(d, **changed)


def test_running_text_is_detokenized_for_a_plain_running_delta():
    d = Delta("r", (4,), num_cached_tokens=3, scheduled_at=2.0, index=1, draft_tokens=2,
              accepted_tokens=1)
    assert d.running_text("x") == d.detokenized("x", (), None, None, d.token_ids, (), ())


def test_step_with_deltas_keeps_every_other_field():
    import attrs
    step = Step(3, (), (Delta("a"),), num_running=1, num_waiting=2, kv_blocks_used=3, done_at=4.0, engine=1)
    new = (Delta("b"),)
    assert step.with_deltas(new) == attrs.evolve(step, deltas=new)
    assert len(attrs.fields(Step)) == 8    # with_deltas names each of them


def test_the_event_log_writes_a_delta_as_its_fields_off_their_defaults():
    from pipeline.core.events import _write_delta
    assert _write_delta(Delta("a")) == {"request_id": "a"}
    assert _write_delta(Delta("a", (0,), FinishReason.STOP, 0, text="x")) == {
        "request_id": "a", "token_ids": (0,), "finish_reason": FinishReason.STOP,
        "stop_reason": 0, "text": "x"}          # a stop token id 0 still shows
    d = _every_field_set()
    assert list(_write_delta(d)) == list(vars(d))   # every field, in field order
