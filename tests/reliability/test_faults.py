"""Faults: a GPU step that raises fails its own requests only; an error that leaves the
engine unusable stops it cleanly (/health 503, every request ends, non-zero exit).

The fault hook is --fault-steps / TAILRACE_FAULT_STEPS (stages/gpu_step.py): "N" makes
step N raise after the model ran, "N:fatal" makes it lose the device.
"""
from __future__ import annotations

import httpx
import orjson
import pytest
import torch
import trio

from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from pipeline.tools.harness import ScriptedRunner, run_stage
from tests.support.live_servers import record, served, settled, sse_events
from stages import gpu_step

STREAM = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "stream": True}


def one_error_then_done(raw: bytes) -> str:
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    errors = [orjson.loads(e)["error"] for e in events[:-1] if b'"error"' in e]
    assert len(errors) == 1 and b'"error"' in events[-2]
    return errors[0]["message"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "not-streamed"])
async def test_a_failed_step_fails_its_requests_and_the_next_ones_succeed(smollm, stream):
    async with served(smollm, fault_steps="1") as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/completions", json={**STREAM, "stream": stream})
            if stream:
                assert r.status_code == 200
                assert "injected fault at step 1" in one_error_then_done(r.content)
            else:
                assert r.status_code == 500
                assert "injected fault at step 1" in r.json()["error"]["message"]
            for _ in range(2):
                ok = await http.post("/v1/completions", json={**STREAM, "stream": False})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
            assert (await http.get("/health")).status_code == 200
            after = await settled(engine)
    assert after["kv_blocks_used"] == 0
    finished = engine.stats().requests_finished_total
    assert finished == {"error": 1, "length": 2}


def test_step_faults_are_parsed_and_checked():
    from pipeline.core.config import EngineConfig, parse_fault_steps

    assert parse_fault_steps("") == {}
    assert parse_fault_steps("3, 7:fatal") == {3: "error", 7: "fatal"}
    for bad in ("x", "0", "3:boom", "-1"):
        with pytest.raises(ValueError):
            EngineConfig(fault_steps=bad)


def _plan(step: int) -> StepPlan:
    return StepPlan(step, (SeqChunk("a", (1, 2), 0, (0,), True),),
                    (SeqStart("a", (1, 2), SamplingOptions()),))


class LostDevice(ScriptedRunner):
    def execute(self, plan):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


async def test_the_gpu_stage_raises_when_the_device_is_lost():
    """Through the harness: a device error is not one failed step but the end of the
    engine (EngineDead out of the stage); a plain error fails one step."""
    with pytest.raises(BaseExceptionGroup) as info:
        await run_stage(gpu_step.run, inputs={"receive": [_plan(1)]}, outputs=("send",),
                        runner=LostDevice(lambda sid, n: 5))
    assert info.group_contains(gpu_step.EngineDead, match="illegal memory access")
    out = await run_stage(gpu_step.run, inputs={"receive": [_plan(1), _plan(2)]},
                          outputs=("send",), runner=ScriptedRunner(lambda sid, n: 5),
                          faults={1: "error"})
    assert [r.error is not None for r in out["send"]] == [True, False]


async def test_every_failed_step_is_logged_with_its_traceback(caplog):
    """No event log is set here: the failure and where it came from still reach the log."""
    caplog.set_level("ERROR", logger="tailrace.gpu")
    out = await run_stage(gpu_step.run, inputs={"receive": [_plan(1), _plan(2)]},
                          outputs=("send",), runner=ScriptedRunner(lambda sid, n: 5),
                          faults={2: "error"})
    assert [r.error for r in out["send"]] == [None, "StepFault: injected fault at step 2"]
    failed = [r for r in caplog.records if r.name == "tailrace.gpu"]
    assert len(failed) == 1 and "step 2 failed" in failed[0].getMessage()
    assert failed[0].exc_info is not None and "_execute" in caplog.text   # the traceback


async def test_consecutive_failed_steps_stop_the_engine():
    plans = [_plan(i) for i in range(1, gpu_step.MAX_CONSECUTIVE_FAILURES + 2)]
    with pytest.raises(BaseExceptionGroup) as info:
        await run_stage(gpu_step.run, inputs={"receive": plans}, outputs=("send",),
                        runner=ScriptedRunner(lambda sid, n: 5),
                        faults={p.step: "error" for p in plans})
    assert info.group_contains(gpu_step.EngineDead)


async def test_a_stage_that_raises_stops_the_engine_and_no_request_hangs(smollm):
    """Over HTTP: the stream in flight ends with an error and [DONE], a non-streamed request
    gets a 500 body, /health and new requests get 503, and the error leaves open_engine."""
    with trio.fail_after(60), pytest.raises(BaseExceptionGroup) as info:
        async with served(smollm) as (engine, url):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                real = engine.scheduler.update

                def update(plan, result):
                    if plan.step >= 3:
                        raise RuntimeError("detokenize exploded")   # any stage, any bug
                    return real(plan, result)

                engine.scheduler.update = update
                results = {}

                async def go(name: str, body: dict) -> None:
                    results[name] = await http.post("/v1/completions", json=body)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(go, "stream", {**STREAM, "max_tokens": 50})
                    nursery.start_soon(go, "plain", {**STREAM, "stream": False, "max_tokens": 50})
                health = await http.get("/health")
                refused = await http.post("/v1/completions", json={**STREAM, "stream": False})
    assert info.group_contains(RuntimeError, match="detokenize exploded")
    assert results["stream"].status_code == 200
    assert "engine stopped" in one_error_then_done(results["stream"].content)
    assert results["plain"].status_code == 500
    assert "detokenize exploded" in results["plain"].json()["error"]["message"]
    assert health.status_code == 503
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stopped"


async def test_a_lost_device_stops_the_engine(smollm):
    """The fault hook loses the device at step 3: the request ends with an error and
    [DONE], /health turns 503, and the engine's error leaves open_engine (tailrace serve
    then exits 1: tests/web/test_app.py)."""
    with trio.fail_after(60), pytest.raises(BaseExceptionGroup) as info:
        async with served(smollm, fault_steps="3:fatal") as (engine, url):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                r = await http.post("/v1/completions", json={**STREAM, "max_tokens": 20})
                health = await http.get("/health")
                refused = await http.post("/v1/completions", json={**STREAM, "stream": False})
    assert info.group_contains(gpu_step.EngineDead, match="injected fatal fault at step 3")
    assert r.status_code == 200
    assert "injected fatal fault at step 3" in one_error_then_done(r.content)
    assert health.status_code == 503 and refused.status_code == 503
    record("lost device (fault hook, step 3:fatal)", sent=2, aborted=1, completed=0, refused=1,
           health_after=health.status_code)
