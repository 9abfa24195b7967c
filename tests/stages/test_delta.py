"""The one delta shape: the event log's converter round-trips a Step's deltas, FinishReason
included (requests are covered by the engine's replay test)."""
import orjson

from gpu.runner import TokenLogprobs
from pipeline.events import structure_step, unstructure
from stages.delta import Delta, FinishReason, TokenLogprob, Usage
from stages.schedule import Step


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
