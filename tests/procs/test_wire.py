"""The wire between the engine and frontend processes (pipeline/layouts/wire.py): Step frames
round-trip exactly, whatever is in the deltas (kv_transfer_params too), and frames survive any split of the
byte stream."""
import socket

import trio

from gpu.interface import TokenLogprobs
from pipeline.layouts.wire import OBJ, STEP, Link, Refused, pack, pack_step, unpack_step
from stages.delta import Delta, FinishReason
from stages.messages import Abort, Step


def _step() -> Step:
    lp = TokenLogprobs(-0.5, (3, 4), (-0.5, -1.25))
    return Step(7, (), (
        Delta("a", (11,), scheduled_at=1.5, num_cached_tokens=16),
        Delta("b", (12, 13), FinishReason.STOP, 2, index=1, scheduled_at=2.0),
        Delta("c", (), FinishReason.ERROR, None, error="boom"),
        Delta("d", (14,), token_logprobs=(lp,), prompt_token_logprobs=(None, lp)),
        Delta("e", (15,), FinishReason.STOP, "stop here"),
        Delta("f", (16,), FinishReason.LENGTH, kv_transfer_params={   # a prefill's reply
            "do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_port": 5600}),
    ), num_running=3, num_waiting=1, kv_blocks_used=9, done_at=12.25)


def test_a_step_round_trips():
    step = _step()
    frame = pack_step(step, [], [(d.request_id, d) for d in step.deltas])
    assert frame[4] == STEP
    assert unpack_step(frame[5:], {}) == step


def test_new_requests_are_named_by_id_and_renamed_deltas_keep_the_frontends_ids():
    step = _step()
    held = {"x": "the frontend's own request"}
    items = [("local-" + d.request_id, d) for d in step.deltas[:1]]
    out = unpack_step(pack_step(step, ["x"], items)[5:], held)
    assert out.new_requests == ("the frontend's own request",)
    assert held == {}                                # each request is new once
    assert [d.request_id for d in out.deltas] == ["local-a"]
    assert out.deltas[0].token_ids == (11,) and out.deltas[0].num_cached_tokens == 16


async def test_frames_survive_any_split_of_the_stream():
    a, b = socket.socketpair()
    left = Link(trio.socket.from_stdlib_socket(a))
    right = Link(trio.socket.from_stdlib_socket(b))
    step = _step()
    frames = [pack(Abort("r1", "why")), pack_step(step, [], [(d.request_id, d) for d in step.deltas]),
              pack(Refused("r2", "no", 503, "server_overloaded")), pack("x" * 300_000)]
    blob = b"".join(frames)

    async def write_in_odd_pieces() -> None:
        for i in range(0, len(blob), 997):           # cut anywhere, headers included
            await left.send_frame(blob[i:i + 997])
        left.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_in_odd_pieces)
        got = [await right.receive_frame() for _ in frames]
        try:
            await right.receive_frame()
            raise AssertionError("no EndOfChannel")
        except trio.EndOfChannel:
            pass
    assert [kind for kind, _ in got] == [OBJ, STEP, OBJ, OBJ]
    assert unpack_step(got[1][1], {}) == step
    right.close()


async def test_what_send_first_queued_precedes_the_next_frame_whoever_sends_it():
    """The engine's Accepted goes through its outbox's forward task, a Step frame from route
    directly: the Accepted, queued first, is on the wire first even when route writes
    before forward has run; forward's nudge then sends nothing twice."""
    import pickle
    from pipeline.layouts.wire import NUDGE, forward, outbox
    a, b = socket.socketpair()
    left = Link(trio.socket.from_stdlib_socket(a))
    right = Link(trio.socket.from_stdlib_socket(b))
    step = _step()
    send, receive = outbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward, receive, left)
        left.send_first(Refused("r2", "no", 503, "server_overloaded"))
        send.send_nowait(NUDGE)
        # no checkpoint between: forward has not run yet
        await left.send_frame(pack_step(step, [], [(d.request_id, d) for d in step.deltas]))
        send.send_nowait(Abort("r1", "why"))
        got = [await right.receive_frame() for _ in range(3)]
        send.close()
    assert [kind for kind, _ in got] == [OBJ, STEP, OBJ]
    assert pickle.loads(got[0][1]) == Refused("r2", "no", 503, "server_overloaded")
    assert pickle.loads(got[2][1]) == Abort("r1", "why")
    left.close()
    right.close()
