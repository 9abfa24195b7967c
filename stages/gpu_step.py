"""gpu step: runs each StepPlan on the model runner in one worker thread.

The runner is synchronous code (gpu/ imports no trio). One thread with a
CapacityLimiter of 1 keeps the event loop serving HTTP while a step runs; a
cancellation lands between steps, never inside one.
"""
from __future__ import annotations

import trio

from gpu.runner import ModelRunner


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              runner: ModelRunner, log=None) -> None:
    limiter = trio.CapacityLimiter(1)
    async with receive, send:
        async for plan in receive:
            result = await trio.to_thread.run_sync(runner.execute, plan, limiter=limiter,
                                                   abandon_on_cancel=False)
            await send.send(result)
