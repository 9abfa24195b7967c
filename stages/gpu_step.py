"""gpu step: runs each StepPlan on the model runner in one worker thread.

The runner is synchronous code (gpu/ imports no trio). Steps run one at a time
(this loop awaits each before taking the next plan) in a worker thread, which keeps
the event loop serving HTTP while a step runs; a cancellation lands between steps,
never inside one.
"""
from __future__ import annotations

import trio

from gpu.runner import ModelRunner, StepResult


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              runner: ModelRunner, log=None) -> None:
    async with receive, send:
        async for plan in receive:
            try:
                result = await trio.to_thread.run_sync(runner.execute, plan,
                                                       abandon_on_cancel=False)
            except Exception as exc:  # the step's requests fail; the server keeps serving
                if log is not None:
                    log("step_failed", step=plan.step, error=repr(exc))
                result = StepResult(plan.step, (), (), 0.0, error=f"{type(exc).__name__}: {exc}")
            if log is not None:
                log("step", step=plan.step, seqs=len(plan.chunks),
                    tokens=sum(len(c.token_ids) for c in plan.chunks), duration_s=result.duration_s)
            await send.send(result)
