"""The stage-level harness: run ONE stage with scripted input messages and collect
every message it sends.

    out = await run_stage(parse.run, inputs={"receive": [step1, step2]},
                          outputs=("send",), core=parse.Parser())
    assert out["send"] == [...]

Each name in ``inputs`` becomes a receive channel pre-loaded with the messages and then
closed, so the stage sees end-of-input and exits the way it does at shutdown. Each name
in ``outputs`` becomes a send channel whose messages are collected. Other keyword
arguments go to the stage unchanged (its core, replies registry, log, ...). A deadline
turns a stage that hangs into a test failure instead of a hung suite.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio


class Recorder:
    """A ``log(event, **fields)`` callable that keeps what a stage logged."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields})

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


async def run_stage(stage: Callable[..., Awaitable[None]], *, inputs: dict[str, list],
                    outputs: tuple[str, ...] = ("send",), timeout: float = 30.0,
                    **kwargs: Any) -> dict[str, list]:
    collected: dict[str, list] = {name: [] for name in outputs}
    channels: dict[str, Any] = {}
    for name, messages in inputs.items():
        send, receive = trio.open_memory_channel(max(1, len(messages)))
        for m in messages:
            send.send_nowait(m)
        send.close()
        channels[name] = receive

    async def collect(name: str, receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for m in receive:
                collected[name].append(m)

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            for name in outputs:
                send, receive = trio.open_memory_channel(0)
                channels[name] = send
                nursery.start_soon(collect, name, receive)
            await stage(**channels, **kwargs)
    return collected


class ScriptedRunner:
    """Stands in for gpu.worker.runner.ModelRunner: returns scripted tokens per sequence."""

    def __init__(self, script: Callable[[str, int], int]) -> None:
        self.script = script           # (seq_id, output index) -> token id
        self.plans: list = []
        self._produced: dict[str, int] = {}

    def execute(self, plan):
        from gpu.interface import StepResult

        self.plans.append(plan)
        for sid in plan.released:
            self._produced.pop(sid, None)
        ids, toks = [], []
        for c in plan.chunks:
            if c.sample:
                n = self._produced.get(c.seq_id, 0)
                ids.append(c.seq_id)
                toks.append(self.script(c.seq_id, n))
                self._produced[c.seq_id] = n + 1
        return StepResult(plan.step, tuple(ids), tuple(toks), 0.0)
