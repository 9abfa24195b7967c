"""gpu step: runs each StepPlan on the model runner in one worker thread.

The runner is synchronous code (gpu/ imports no trio). Steps run one at a time
(this loop awaits each before taking the next plan) in a worker thread, which keeps
the event loop serving HTTP while a step runs; a cancellation lands between steps,
never inside one.

A step that raises fails its own requests (a StepResult with the error) and the next
step runs as usual. Every failure is logged (logger "tailrace.gpu", with its traceback),
whether or not an event log is set. An error that leaves the device unusable does not: a CUDA error
(torch.AcceleratorError: the CUDA context is lost after one), or
MAX_CONSECUTIVE_FAILURES failed steps in a row, raises EngineDead out of this stage,
which stops the engine (pipeline/engine.py: /health turns 503, every request in flight
ends with an error, the server exits non-zero).

Fault injection, for tests (off unless asked for): ``faults`` maps a step number to
"error" (that step raises StepFault after the model ran) or "fatal" (it raises
DeviceLost, which counts as a lost device). The engine fills it from
``--fault-steps`` / ``TAILRACE_FAULT_STEPS`` (pipeline/config.py).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import trio

from gpu.runner import ModelRunner, StepPlan, StepResult

_log = logging.getLogger("tailrace.gpu")

MAX_CONSECUTIVE_FAILURES = 3
FAULT_KINDS = ("error", "fatal")


class StepFault(RuntimeError):
    """Raised by the fault hook: a step that fails on its own."""


class DeviceLost(RuntimeError):
    """The device can run no further step (raised by the fault hook as "fatal")."""


class EngineDead(RuntimeError):
    """The GPU stage cannot go on: the engine must stop."""


def _fatal(exc: BaseException) -> bool:
    return isinstance(exc, (DeviceLost, torch.AcceleratorError))


def _execute(runner: ModelRunner, plan: StepPlan, fault: str | None) -> StepResult:
    result = runner.execute(plan)
    if fault == "fatal":
        raise DeviceLost(f"injected fatal fault at step {plan.step}")
    if fault == "error":
        raise StepFault(f"injected fault at step {plan.step}")
    return result


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              runner: ModelRunner, log=None, *, faults: Mapping[int, str] | None = None) -> None:
    faults = faults or {}
    failed_in_a_row = 0
    async with receive, send:
        async for plan in receive:
            try:
                result = await trio.to_thread.run_sync(_execute, runner, plan,
                                                       faults.get(plan.step),
                                                       abandon_on_cancel=False)
                failed_in_a_row = 0
            except Exception as exc:
                failed_in_a_row += 1
                error = f"{type(exc).__name__}: {exc}"
                # always, with the traceback: a failed step's cause must never be lost
                # (the event log, when set, gets the one line too)
                _log.error("step %d failed (%d sequences): %s", plan.step, len(plan.chunks),
                           error, exc_info=exc, extra={"step": plan.step,
                                                       "sequences": len(plan.chunks)})
                if log is not None:
                    log("step_failed", step=plan.step, error=error)
                if _fatal(exc) or failed_in_a_row >= MAX_CONSECUTIVE_FAILURES:
                    raise EngineDead(f"the GPU step failed and cannot recover: {error}") from exc
                # the step's requests fail; the server keeps serving
                result = StepResult(plan.step, (), (), 0.0, error=error)
            if log is not None:
                log("step", step=plan.step, seqs=len(plan.chunks),
                    tokens=sum(len(c.token_ids) for c in plan.chunks), duration_s=result.duration_s)
            await send.send(result)
