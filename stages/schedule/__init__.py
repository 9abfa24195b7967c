"""schedule: the stage that plans each engine step and turns its result into a Step.

- scheduler.py: `Scheduler`, the pure core (queues, KV blocks, prefix hashes, preemption);
  it plans a step once the one before has come back.
- async_.py: `AsyncScheduler(Scheduler)`, which plans one step ahead with PLACEHOLDERs
  (--async-scheduling); startup.build picks the class.
- stop.py: the stop rule; spec.py: speculative decoding's drafts and counts; sequence.py:
  the per-choice state; blocks.py: the block manager; drafter.py: the n-gram drafter.

This module is the async shell around the core: `run`.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import trio

from gpu.interface import StepPlan
from stages.delta import FinishReason
from stages.messages import Abort, Control, FinishRequest, KVRelease, RenderedRequest, Step
from stages.schedule.async_ import AsyncScheduler
from stages.schedule.scheduler import Scheduler
from stages.schedule.sequence import Sequence, sampling_options
from stages.schedule.spec import SpecCounters

__all__ = ["AsyncScheduler", "Scheduler", "Sequence", "SpecCounters", "run", "sampling_options"]


class _CompileWakeup:
    """A trio.Event set when a watched grammar finishes compiling in its worker thread:
    the future's callback runs there and hands the set to the trio loop (run_sync_soon is
    thread-safe). `reset()` before looking at the grammars again, so that none that
    finishes after the look is missed."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._watched: set[Future] = set()
        self.event = trio.Event()

    def watch(self, grammars: set[Future]) -> None:
        for fut in grammars - self._watched:
            self._watched.add(fut)
            fut.add_done_callback(self._done)   # at once if already done

    def reset(self) -> None:
        if self.event.is_set():
            self.event = trio.Event()

    def _done(self, fut: Future) -> None:       # the worker thread (or this one)
        try:
            self._token.run_sync_soon(self._finished, fut)
        except trio.RunFinishedError:
            pass                                # the engine has stopped: nothing to wake

    def _finished(self, fut: Future) -> None:
        self._watched.discard(fut)
        self.event.set()


async def _message_or(inbox: trio.MemoryReceiveChannel, event: trio.Event):
    """The inbox's next message, or None once `event` is set (whichever comes first; a
    closed inbox leaves only the event). Receiving is cancel-safe: no message is lost."""
    got = []
    async with trio.open_nursery() as nursery:
        async def receive() -> None:
            try:
                got.append(await inbox.receive())
            except trio.EndOfChannel:
                await trio.sleep_forever()
            nursery.cancel_scope.cancel()

        async def wait() -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(receive)
        nursery.start_soon(wait)
    return got[0] if got else None


async def run(inbox: trio.MemoryReceiveChannel, to_gpu: trio.MemorySendChannel,
              from_gpu: trio.MemoryReceiveChannel, downstream: trio.MemorySendChannel,
              scheduler: Scheduler, log=None, sleeper=None) -> None:
    """Engine loop: take everything in the inbox, plan, run one step, forward the result.

    Up to scheduler.max_in_flight steps run at once: with AsyncScheduler the next step is
    planned and sent while the current one runs. Results come back in plan order.

    Control messages (issue 37): a prefix-cache reset happens as it comes; a sleep waits
    until no step is in flight and nothing runs, then `sleeper` (gpu/worker/sleep.py, None without
    --enable-sleep-mode) lets go of the runner's memory in a worker thread, and nothing is
    planned until the wake-up (requests that arrive meanwhile wait)."""
    depth = scheduler.max_in_flight
    inflight: deque[tuple[StepPlan, tuple[str, ...]]] = deque()   # plans sent, their preemptions
    compiled = _CompileWakeup()
    controls: deque[Control] = deque()          # sleeps and wake-ups, in order
    asleep = False

    def take(msg) -> None:
        if isinstance(msg, RenderedRequest):
            scheduler.add(msg)
        elif isinstance(msg, Abort):
            if msg.error is None:
                scheduler.finish(msg.request_id, FinishReason.ABORT)
            else:
                scheduler.finish(msg.request_id, FinishReason.ERROR, msg.error)
        elif isinstance(msg, FinishRequest):
            scheduler.finish(msg.request_id, FinishReason.STOP, index=msg.index)
        elif isinstance(msg, KVRelease):
            scheduler.kv.release(msg.request_ids, msg.expire)
        elif isinstance(msg, Control):
            if msg.op == "reset_prefix_cache":
                msg.answer(scheduler.reset_prefix_cache(msg.reset_running))
            else:
                controls.append(msg)
        else:
            raise TypeError(f"schedule got {type(msg).__name__}")

    async def forward(plan: StepPlan | None, preempted: tuple[str, ...], out: Step) -> None:
        if log is not None and plan is not None and (out.new_requests or out.deltas
                                                     or plan.chunks or preempted):
            # the whole message: enough to replay everything downstream
            log("scheduled", plan=plan, preempted=preempted, message=out)
        if out.new_requests or out.deltas:
            await downstream.send(out)

    # A step's result, applied but not yet passed on: the next plan goes to the GPU first,
    # so the runner never waits behind detokenize..emit taking their turn in the loop.
    applied: tuple[StepPlan, tuple[str, ...], Step] | None = None

    async def control(msg: Control) -> None:
        nonlocal asleep
        error = None
        if sleeper is None:
            error = "sleep mode is off (start the server with --enable-sleep-mode)"
        else:
            try:
                if msg.op == "sleep":
                    await trio.to_thread.run_sync(sleeper.sleep, msg.level)
                    if msg.level and not scheduler.reset_prefix_cache():   # KV contents gone
                        raise RuntimeError("blocks still held while going to sleep")
                    asleep = True
                else:
                    await trio.to_thread.run_sync(sleeper.wake_up)
                    asleep = False
            except Exception as exc:     # a failed wake-up leaves the engine asleep
                error = f"{type(exc).__name__}: {exc}"
        msg.answer(error)

    def quiet() -> bool:
        return not inflight and applied is None and not scheduler.running

    async with inbox, to_gpu, downstream:
        while True:
            while controls and (controls[0].op == "wake_up" or asleep or quiet()):
                await control(controls.popleft())
            if asleep:       # plan nothing: take messages, pass on finishes (aborts)
                try:
                    take(await inbox.receive())
                except trio.EndOfChannel:
                    return
                out = scheduler.drain()
                await forward(None, (), out)
                continue
            if not scheduler.has_work() and not inflight and applied is None:
                try:
                    take(await inbox.receive())
                except trio.EndOfChannel:
                    return
            while True:
                try:
                    take(inbox.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            plan = None
            if (len(inflight) < depth and scheduler.has_work()
                    and (not inflight or scheduler.may_plan_ahead())):
                compiled.reset()        # before schedule() looks at the grammars
                plan = scheduler.schedule()
                # kv_updates alone too: a chunk taken back by a preemption keeps its block's slot
                if (plan.chunks or plan.new_seqs or plan.released or plan.kv_updates
                        or plan.kv_reads or plan.kv_waiting):
                    await to_gpu.send(plan)
                    inflight.append((plan, tuple(scheduler.preempted)))
                    if len(inflight) < depth and applied is None and scheduler.may_plan_ahead():
                        continue        # plan the next step while this one runs
            if applied is not None:
                await forward(*applied)
                applied = None
            if inflight:
                done, preempted = inflight.popleft()
                applied = (done, preempted, scheduler.update(done, await from_gpu.receive()))
                continue
            out = scheduler.drain()
            await forward(plan, tuple(scheduler.preempted) if plan is not None else (), out)
            if not (out.new_requests or out.deltas) and plan is not None and not plan.chunks:
                grammars = scheduler.grammars_compiling()
                if grammars:
                    # nothing runs until a grammar is ready or a message comes
                    compiled.watch(grammars)
                    msg = await _message_or(inbox, compiled.event)
                    if msg is not None:
                        take(msg)
                else:
                    await trio.sleep(0)     # waiting on blocks freed by nothing: let others run
