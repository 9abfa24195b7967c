"""The pipeline's two halves (pipeline/core/assembly.py), each driven alone through the
channels a layout puts at its cuts, with no processes: scripted requests into the engine
core, its Steps into a request side, and both joined by a stand-in for the wire that
pickles every message crossing, as the frontend layout's does. Each gives the bytes the
one-process engine gives. The GPU is the stand-in (--simulate-gpu), so no weights load."""
from __future__ import annotations

import pickle

import attrs
import orjson
import pytest
import torch
import trio

from pipeline.core.assembly import (RequestSideSpec, core_admission, inbox_channel,
                                    start_engine_core, start_request_side)
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from pipeline.core.startup import build
from stages.admit import Accepted
from stages.delta import FinishReason
from stages.replies import Replies
from stages.messages import Abort, RenderedRequest, Step, Submission

CFG = EngineConfig(simulate_gpu="h200", max_model_len=128, max_num_seqs=4, seed=0)
BODY = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "seed": 7,
        "temperature": 1.0, "n": 2, "logprobs": 1}


@pytest.fixture
def built():
    """A fresh build each test: the stand-in's tokens are drawn from a generator seeded at
    start-up, so a fresh one-process engine draws the same tokens."""
    return build(CFG, torch.device("cpu"), None)


def _body(built, **extra):
    return {"model": built.model_names[0], **BODY, **extra}


async def _one_process(cfg: EngineConfig, body: dict) -> bytes:
    async with open_engine(cfg) as engine:
        reply = await engine.submit("completions", body, request_id="r")
        return await reply.read()


def _without_timing(raw: bytes) -> dict:
    out = orjson.loads(raw)
    out.pop("created", None)
    return out


async def _render(built, spec, body: dict) -> RenderedRequest:
    """One request through a request side's render alone (the requests cut)."""
    async with trio.open_nursery() as nursery:
        requests_in, requests_out = trio.open_memory_channel(1)
        steps_in, steps_out = trio.open_memory_channel(1)
        back_in, _back_out = trio.open_memory_channel(8)
        side = start_request_side(nursery, spec, requests=requests_in, steps=steps_out,
                                  back_edges=back_in, events=None)
        side.replies.open("r")
        await side.render_in.send(Submission("r", "completions", body, 0.0))
        req = await requests_out.receive()
        nursery.cancel_scope.cancel()
    return req


async def _core_steps(built, requests: list[RenderedRequest], aborts=()) -> list[Step]:
    """The engine core alone: scripted requests in, every Step out until each finished."""
    replies = Replies(CFG.max_model_len + 4)
    for r in requests:
        replies.open(r.request_id)
    open_choices = sum(r.num_choices for r in requests)
    steps: list[Step] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            requests_in, requests_out = trio.open_memory_channel(len(requests))
            steps_in, steps_out = trio.open_memory_channel(1)
            inbox = inbox_channel(CFG)
            start_engine_core(nursery, CFG, built, replies=replies,
                              admission=core_admission(CFG, built, lambda: replies.num_admitted),
                              requests=requests_out, inbox=inbox, steps=steps_in, events=None)
            for r in requests:
                requests_in.send_nowait(r)
            async for step in steps_out:
                steps.append(step)
                for rid in aborts:
                    if any(d.request_id == rid for d in step.deltas):
                        inbox[0].send_nowait(Abort(rid))
                open_choices -= sum(d.finish_reason is not None for d in step.deltas)
                if open_choices == 0:
                    break
            nursery.cancel_scope.cancel()
    return steps


async def test_engine_core_alone_runs_requests_to_their_end_and_takes_aborts(built):
    spec = RequestSideSpec.of(CFG, built)
    req = await _render(built, spec, _body(built))
    other = attrs.evolve(await _render(built, spec, _body(built, max_tokens=40)),
                         request_id="gone")
    steps = await _core_steps(built, [req, other], aborts=("gone",))
    finishes = {(d.request_id, d.index): d.finish_reason
                for s in steps for d in s.deltas if d.finish_reason is not None}
    assert finishes[("r", 0)] == finishes[("r", 1)] == FinishReason.LENGTH
    assert finishes[("gone", 0)] == finishes[("gone", 1)] == FinishReason.ABORT
    tokens = sum(len(d.token_ids) for s in steps for d in s.deltas if d.request_id == "r")
    assert tokens == 2 * BODY["max_tokens"]
    assert built.blocks.num_used == 0          # every block given back


async def test_request_side_alone_turns_the_cores_steps_into_the_same_reply(built):
    spec = RequestSideSpec.of(CFG, built)
    req = await _render(built, spec, _body(built))
    steps = await _core_steps(built, [req])
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            requests_in, _requests_out = trio.open_memory_channel(1)
            steps_in, steps_out = trio.open_memory_channel(len(steps))
            back_in, _back_out = trio.open_memory_channel(8)
            side = start_request_side(nursery, spec, requests=requests_in, steps=steps_out,
                                      back_edges=back_in, events=None)
            receive = side.replies.open("r")
            side.replies.admit("r")
            side.replies.send("r", Accepted("r", False))
            assert await receive.receive() == Accepted("r", False)
            for s in steps:
                steps_in.send_nowait(s)
            chunks = [c async for c in receive]
            nursery.cancel_scope.cancel()
    raw = b"".join(c for c in chunks if isinstance(c, bytes))
    assert _without_timing(raw) == _without_timing(await _one_process(CFG, _body(built)))


async def test_halves_joined_through_pickled_messages_equal_one_process(built):
    """The frontend layout's cut without processes: every message crossing the cut (a
    request, a Step, a back-edge) goes through pickle, as over the wire."""
    spec = pickle.loads(pickle.dumps(RequestSideSpec.of(CFG, built)))
    core_replies = Replies(CFG.max_model_len + 4)

    async def carry(receive, send, on=None):
        async with receive, send:
            async for msg in receive:
                msg = pickle.loads(pickle.dumps(msg))
                if on is not None:
                    on(msg)
                await send.send(msg)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            # the request side (a frontend's)
            fe_requests_in, fe_requests_out = trio.open_memory_channel(0)
            fe_steps_in, fe_steps_out = trio.open_memory_channel(1)
            fe_back_in, fe_back_out = trio.open_memory_channel(64)
            side = start_request_side(nursery, spec, requests=fe_requests_in,
                                      steps=fe_steps_out, back_edges=fe_back_in, events=None)
            # the engine core (the engine process's)
            core_requests_in, core_requests_out = trio.open_memory_channel(0)
            core_steps_in, core_steps_out = trio.open_memory_channel(1)
            inbox = inbox_channel(CFG)
            start_engine_core(nursery, CFG, built, replies=core_replies,
                              admission=core_admission(CFG, built,
                                                       lambda: core_replies.num_admitted),
                              requests=core_requests_out, inbox=inbox, steps=core_steps_in,
                              events=None)

            answers: dict[str, trio.MemoryReceiveChannel] = {}

            def opened(req):   # the engine's EngineReplies entry, as the wire's reader adds it
                answers[req.request_id] = core_replies.open(req.request_id)

            nursery.start_soon(carry, fe_requests_out, core_requests_in, opened)
            nursery.start_soon(carry, core_steps_out, fe_steps_in)
            nursery.start_soon(carry, fe_back_out, inbox[0].clone())

            reply = side.replies.open("r")
            await side.render_in.send(Submission("r", "completions", _body(built), 0.0))
            while "r" not in answers:
                await trio.sleep(0.01)
            # admit's answer crosses back and lands on the frontend's reply channel
            answer = pickle.loads(pickle.dumps(await answers["r"].receive()))
            assert answer == Accepted("r", False)
            side.replies.admit("r")
            side.replies.send("r", answer)
            assert await reply.receive() == answer
            chunks = [c async for c in reply]
            nursery.cancel_scope.cancel()
    raw = b"".join(c for c in chunks if isinstance(c, bytes))
    assert _without_timing(raw) == _without_timing(await _one_process(CFG, _body(built)))
