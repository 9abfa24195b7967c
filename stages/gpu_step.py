"""gpu step: runs each StepPlan on the model runner in one worker thread.

The runner is synchronous code (gpu/ imports no trio). Steps run one at a time, in
plan order, in one runner thread fed through a queue, which keeps the event loop
serving HTTP while a step runs; a cancellation lands between steps, never inside one.
With async scheduling (stages/schedule/async_.py) the next plan is already queued when a step
ends, so the thread starts it at once instead of waiting for the event loop to notice.
A plan's host-side input preparation (`runner.stage`) runs here in the event loop as the
plan arrives, while the step before it runs: between one step's end and the next one's
start the runner thread only fills in the PLACEHOLDER tokens and uploads the inputs.
The runner thread and the event loop share the GIL: the runtime that starts this stage
lowers the interpreter's switch interval for it (pipeline/layouts/process.py,
`runner_switch_interval`); the stage itself changes no process-wide setting.

A step that raises fails its own requests (a StepResult with the error) and the next
step runs as usual. Every failure is logged (logger "tailrace.gpu", with its traceback),
whether or not an event log is set. An error that leaves the device unusable does not: a CUDA error
(torch.AcceleratorError: the CUDA context is lost after one), a lost tensor-parallel
rank (gpu.interface.TPLost), or
MAX_CONSECUTIVE_FAILURES failed steps in a row, raises EngineDead out of this stage,
which stops the engine (pipeline/core/engine.py: /health turns 503, every request in flight
ends with an error, the server exits non-zero).

Fault injection, for tests (off unless asked for): ``faults`` maps a step number to
"error" (that step raises StepFault after the model ran) or "fatal" (it raises
DeviceLost, which counts as a lost device). The engine fills it from
``--fault-steps`` / ``TAILRACE_FAULT_STEPS`` (pipeline/core/config.py).
"""
from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Mapping

import outcome
import torch
import trio

from gpu.interface import Runner, StagingRunner, StepPlan, StepResult, TPLost
from gpu.config.names import FAULT_KINDS

_log = logging.getLogger("tailrace.gpu")

MAX_CONSECUTIVE_FAILURES = 3



class StepFault(RuntimeError):
    """Raised by the fault hook: a step that fails on its own."""


class DeviceLost(RuntimeError):
    """The device can run no further step (raised by the fault hook as "fatal")."""


class EngineDead(RuntimeError):
    """The GPU stage cannot go on: the engine must stop."""


def _fatal(exc: BaseException) -> bool:
    return isinstance(exc, (DeviceLost, TPLost, torch.AcceleratorError))


def _execute(runner: Runner, plan: StepPlan, fault: str | None,
             staged: outcome.Outcome | None) -> StepResult:
    if staged is None:            # a runner that stages nothing ahead (test doubles)
        result = runner.execute(plan)
    else:
        result = runner.execute(plan, staged.unwrap())
    if fault == "fatal":
        raise DeviceLost(f"injected fatal fault at step {plan.step}")
    if fault == "error":
        raise StepFault(f"injected fault at step {plan.step}")
    return result


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              runner: Runner, log=None, *, faults: Mapping[int, str] | None = None,
              release_team: Callable[[], None] | None = None) -> None:
    """Plans go to one runner thread through a queue, in order; results come back in the
    same order. With async scheduling the next plan is queued while a step runs, so the
    thread starts it the moment the step ends, without waiting for the event loop.
    release_team: lets go of this thread's OpenMP team before the runner thread starts
    (gpu/kernels/cpu/openmp.py release_team, from the assembly)."""
    faults = faults or {}
    failed_in_a_row = 0
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    results_in, results_out = trio.open_memory_channel(math.inf)   # at most the plans queued
    token = trio.lowlevel.current_trio_token()

    def _result(plan: StepPlan, done: outcome.Outcome) -> StepResult:
        nonlocal failed_in_a_row
        if isinstance(done, outcome.Value):
            result = done.value
            failed_in_a_row = 0
        else:
            exc = done.error
            if not isinstance(exc, Exception):
                done.unwrap()
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
        return result

    def deliver(item) -> None:   # in the event loop; None: no more plans
        try:
            if item is None:
                results_in.close()
            else:
                results_in.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass                 # the stage is gone; the engine is stopping

    def work() -> None:          # the runner thread: one step at a time, in plan order
        while True:
            job = jobs.get()
            done = None if job is None else (job[0], outcome.capture(_execute, runner, *job))
            try:
                token.run_sync_soon(deliver, done)
            except trio.RunFinishedError:
                return
            if job is None:
                return

    stage = runner.stage if isinstance(runner, StagingRunner) else None

    async def feed() -> None:
        async for plan in receive:
            # The host half of input preparation, here in the event loop as the plan
            # arrives: the step before is still running, so only the PLACEHOLDERs and the
            # upload are left between its end and this step's start (on the runner thread).
            staged = None if stage is None else outcome.capture(stage, plan)
            jobs.put((plan, faults.get(plan.step), staged))
        jobs.put(None)           # the plans ended: results end after the queued ones

    thread = threading.Thread(target=work, name="tailrace-runner", daemon=True)
    # Start-up's OpenMP team (the weights loaded on this thread) would outlive it and make
    # libgomp throttle the runner thread's team: 70 ms CPU decode steps instead of 46
    # (gpu/kernels/cpu/openmp.py). Nothing on this thread runs parallel regions from here on.
    if release_team is not None:
        release_team()
    thread.start()
    dead: EngineDead | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            try:
                async for plan, done in results_out:
                    await send.send(_result(plan, done))
            except EngineDead as exc:
                dead = exc
            nursery.cancel_scope.cancel()
        if dead is not None:
            # Out of the stage as itself, with its channels left open: the engine's nursery
            # cancels schedule instead of schedule failing on a closed channel as well.
            raise dead
        await receive.aclose()
        await send.aclose()
    finally:
        # Cancellation lands between steps: drop the queued plans, let the thread finish
        # the step it is in (never abandoned mid-step), and wait for it.
        while True:
            try:
                jobs.get_nowait()
            except queue.Empty:
                break
        jobs.put(None)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(thread.join)
