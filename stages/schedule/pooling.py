"""PoolingScheduler: the scheduler of a pooling server (--runner pooling, issue 32).

A pooling request is prefill only: each of its inputs is one sequence, computed whole in
one step and answered with one pooled vector (StepResult.pooled), which ends it. So the
plan is simple: waiting sequences in arrival order, each whole (an encoder attends over
all of a sequence at once: never split across steps), while the step's token budget
(--max-num-batched-tokens, at least max_model_len on a pooling server) and
--max-num-seqs allow. No KV blocks are taken: the runner keeps nothing after the step.
Nothing is preempted. Finishes, aborts and the downstream message are the core
Scheduler's (scheduler.py), which this class inherits.
"""
from __future__ import annotations

import time

from gpu.interface import PoolingOptions, SamplingOptions, SeqChunk, SeqStart, StepPlan, StepResult
from stages.delta import Delta, FinishReason
from stages.messages import Step
from stages.schedule import Scheduler

_NONE = SamplingOptions()
_DEFAULT = PoolingOptions()


class PoolingScheduler(Scheduler):
    """The core Scheduler with a pooling server's plan and update. Its plans are
    independent of the results before them (each takes new sequences only), so the next
    step is planned while one runs: two in flight."""

    max_in_flight = 2

    def schedule(self) -> StepPlan:
        self.step += 1
        self.preempted = []
        budget = self.max_num_batched_tokens
        chunks: list[SeqChunk] = []
        starts: list[SeqStart] = []
        planned = []
        while self.waiting and len(chunks) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.prompt_len
            if n > budget:
                if chunks:
                    break           # the next step takes it whole
                # render refuses what is longer than max_model_len <= the budget: never here
                self.finish(seq.req.request_id, FinishReason.ERROR,
                            f"an input of {n} tokens exceeds the step's budget of {budget}")
                continue
            self.waiting.popleft()
            self.running.append(seq)
            seq.first_scheduled = True
            seq.scheduled_at = time.monotonic()
            prompt = tuple(seq.token_ids)
            work = seq.req.pooling
            options = _DEFAULT if work is None else work.options_of(seq.index)
            starts.append(SeqStart(seq.id, (), _NONE, pooling=options))
            chunks.append(SeqChunk(seq.id, prompt, 0, (), True))
            planned.append((seq, seq.epoch))
            budget -= n
        released, self._released = tuple(self._released), []
        if chunks:
            self._planned[self.step] = planned
        return StepPlan(self.step, tuple(chunks), tuple(starts), released)

    def update(self, plan: StepPlan, result: StepResult) -> Step:
        """Each sequence of the step ends with its vector (Delta.pooled)."""
        planned = self._planned.pop(plan.step, ())
        if result.error is not None:
            for seq, _ in planned:
                if not seq.retired:
                    self.finish(seq.req.request_id, FinishReason.ERROR, result.error)
            return self.drain()
        if plan.chunks:
            self.iteration_tokens.observe(sum(len(c.token_ids) for c in plan.chunks))
        vectors = dict(zip(result.seq_ids, result.pooled))
        deltas = self._pending
        self._pending = []
        for seq, _ in planned:
            if seq.retired:
                continue            # aborted while the step ran: its vector is dropped
            deltas.append(Delta(seq.req.request_id, finish_reason=FinishReason.STOP,
                                scheduled_at=seq.scheduled_at, index=seq.index,
                                pooled=vectors[seq.id]))
            self.running.remove(seq)
            self._retire(seq)
        return self._step(plan.step, deltas)
