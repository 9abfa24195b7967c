"""Priority scheduling (--scheduling-policy priority, as vLLM): a request's `priority`
orders it, lower first, ties by arrival. The waiting queue is kept in that order; when
blocks run short the running sequence that comes last in it is the one preempted, and a
waiting sequence short of blocks preempts a running one that comes after it.

Plain functions over the scheduler's queues (no torch)."""
from __future__ import annotations

import bisect
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.messages import RenderedRequest
    from stages.schedule.sequence import Sequence

POLICIES = ("fcfs", "priority")


def order_key(req: RenderedRequest, arrival: int, index: int) -> tuple[int, int, int]:
    """A sequence's place: its request's priority, the request's arrival (a count, so
    ties are exact), its choice."""
    return (req.priority, arrival, index)


def enqueue(waiting: deque[Sequence], seq: Sequence) -> None:
    """Put `seq` into the waiting queue at its place (after the ones with the same key)."""
    at = bisect.bisect_right(waiting, seq.order, key=lambda s: s.order)
    waiting.insert(at, seq)


def worst_running(running: list[Sequence]) -> Sequence:
    """The running sequence preempted first: the last in priority order."""
    return max(running, key=lambda s: s.order)


def victim_for(seq: Sequence, running: list[Sequence]) -> Sequence | None:
    """The running sequence a waiting `seq` short of blocks preempts: the last in priority
    order, if it comes after `seq` (as vLLM's priority preemption compares (priority,
    arrival))."""
    if not running:
        return None
    victim = worst_running(running)
    return victim if victim.order > seq.order else None
