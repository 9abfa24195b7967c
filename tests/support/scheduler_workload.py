"""The randomised workload that the scheduler's invariant tests drive (test_scheduler_invariants,
test_sliding_blocks): requests with shared prefixes arriving, aborts and stop-string
finishes at any time, a model of the runner that samples tokens (EOS now and then), and
the loop that plans one step ahead of the results (async scheduling). Every random draw is made in one
order, so a seed means the same run in every test."""
from __future__ import annotations

import random
from typing import Callable

from gpu.interface import StepPlan, StepResult
from tests.support.rendered import rendered
from stages.delta import Delta, FinishReason
from stages.schedule import Scheduler

_PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 8)


def sampled_token(rng: random.Random) -> int:
    """What the runner samples: 7, 8 or 9, and now and then 0 (the EOS)."""
    return rng.choice([0, 7, 8, 9]) if rng.random() < 0.1 else rng.choice([7, 8, 9])


class RunnerModel:
    """The runner as the async tests model it: each sequence's prompt and sampled tokens,
    kept from the plans (new sequences in, released ones out), and a token sampled for
    every chunk that samples."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}

    def take(self, plan: StepPlan) -> None:
        """The plan's sequence changes, before its chunks run."""
        for sid in plan.released:
            self.outputs.pop(sid, None)
        for ns in plan.new_seqs:
            self.prompts[ns.seq_id], self.outputs[ns.seq_id] = list(ns.prompt_token_ids), []

    def tokens(self, seq_id: str) -> list[int]:
        """The sequence as the runner knows it: its prompt and the tokens sampled so far."""
        return self.prompts[seq_id] + self.outputs[seq_id]

    def sample(self, plan: StepPlan) -> StepResult:
        """The step's result, once its chunks ran: a token for each that samples."""
        sampled, toks = [], []
        for c in plan.chunks:
            if c.sample:
                tok = sampled_token(self.rng)
                self.outputs[c.seq_id].append(tok)
                sampled.append(c.seq_id)
                toks.append(tok)
        return StepResult(plan.step, tuple(sampled), tuple(toks), 0.0)


class Workload:
    """Up to 20 requests (prompts of 1..max_prompt tokens, 1..max_new new tokens, each let in
    only if it fits the cache's `cap` tokens), and what the scheduler reported of them."""

    def __init__(self, rng: random.Random, s: Scheduler, cap: int, max_prompt: int,
                 max_new: int) -> None:
        self.rng, self.s, self.cap = rng, s, cap
        self.max_prompt, self.max_new = max_prompt, max_new
        self.n = 0                              # requests added, r0 .. r{n-1}
        self.alive: set[str] = set()
        self.finished: dict[str, FinishReason] = {}
        self.max_tokens: dict[str, int] = {}

    def arrive(self) -> None:
        """One step's worth of events: maybe a new request, maybe one finished early."""
        rng = self.rng
        if rng.random() < 0.3 and self.n < 20:
            L = rng.randint(1, self.max_prompt)
            prompt = (rng.choice(_PREFIXES) * 3)[:L]
            mt = rng.randint(1, self.max_new)
            if L + mt <= self.cap:
                rid = f"r{self.n}"
                self.n += 1
                self.s.add(rendered(rid, prompt, max_tokens=mt))
                self.alive.add(rid)
                self.max_tokens[rid] = mt
        if rng.random() < 0.1 and self.alive:
            rid = rng.choice(sorted(self.alive))
            self.s.finish(rid, rng.choice([FinishReason.ABORT, FinishReason.STOP]))

    def record(self, d: Delta) -> None:
        """A delta the scheduler reported: a request finishes exactly once."""
        if d.finished:
            assert d.request_id not in self.finished, ("double finish", d)
            self.finished[d.request_id] = d.finish_reason
            self.alive.discard(d.request_id)

    def run_one_ahead(self, check: Callable[[Scheduler], None], execute: Callable,
                      apply: Callable) -> None:
        """Async scheduling: step N+1 is planned (then checked and executed by the runner
        model, execute(plan) -> result) before step N's result is applied (apply(plan,
        result)). Arrivals for the first 400 steps, then until nothing is left."""
        s = self.s
        ahead = None                          # (plan, result): executed, not applied yet
        for it in range(2400):
            if it < 400:
                self.arrive()
            elif not s.has_work() and ahead is None:
                break
            plan = s.schedule() if s.has_work() else None
            if plan is not None:
                check(s)
                result = execute(plan)
            if ahead is not None:
                apply(*ahead)
            ahead = (plan, result) if plan is not None else None
        if ahead is not None:
            apply(*ahead)
