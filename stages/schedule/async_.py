"""Async scheduling (as vLLM's AsyncScheduler): step N+1 is planned and sent while step N
runs, so the GPU never waits for the host's update, detokenize..emit or the next plan.

A sequence that step N samples is fed that token in step N+1 as a PLACEHOLDER, which the
runner fills in from its own last sample. The sequence counts it in num_pending from the
plan until the result: the plain Scheduler reads num_pending (a sequence whose pending
token ends it by length is not planned again; a sequence preempted with a step in flight
restarts once its token is known), this class keeps it.
"""
from __future__ import annotations

from gpu.interface import PLACEHOLDER, SeqChunk
from stages.schedule.drafter import DRAFT
from stages.schedule.scheduler import Scheduler
from stages.schedule.sequence import Sequence

_PLACEHOLDER = (PLACEHOLDER,)


class AsyncScheduler(Scheduler):
    max_in_flight = 2

    def __init__(self, *args, floating: bool = False, **kwargs) -> None:
        """floating: with n-gram speculation and a runner that fills floating chunks
        (gpu/worker/staging.py float_chunks), steps with drafts are planned ahead as well."""
        super().__init__(*args, **kwargs)
        self.floating = floating and self.speculation is not None
        self.num_floated = 0                 # floating chunks planned (tests, debugging)
        self._drafting: set[int] = set()     # steps in flight with drafts

    def may_plan_ahead(self) -> bool:
        """With speculation, a step is planned ahead only where it would draft nothing:
        drafts need each sequence's last token (a sequence with a step in flight gets
        none), and a verify pass in flight leaves its sequences' positions unknown until
        update rolls the rejected drafts back. So: not while a step with drafts runs, nor
        when the cost gate would draft in the next step (that step waits for the running
        one and drafts); otherwise steps overlap as without speculation."""
        spec = self.speculation
        if spec is None or self.floating:
            return True
        if self._drafting:
            return False
        return not spec.would_draft(self.running, lambda: self.spec_planning.decodes_only(self.running))

    def schedule(self):
        plan = super().schedule()
        if self.speculation is not None and any(c.num_drafts for c in plan.chunks):
            self._drafting.add(plan.step)
        return plan

    def update(self, plan, result):
        if self._drafting:
            self._drafting.discard(plan.step)
        return super().update(plan, result)

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        """Plan the next n tokens of the sequence, the last of them perhaps still on its
        way from the running step: they count as computed from now on; a chunk that ends at
        the sequence's end samples, and its token is pending until update."""
        if self.floating and seq.in_flight_drafts and n == 1:
            return self._float_chunk(seq, 0)    # its position waits for the verify's result
        start = seq.num_computed
        known = len(seq.token_ids)
        end = start + n
        seq.in_flight_tokens += n
        if end <= known:
            tokens = tuple(seq.token_ids[start:end])
        elif start >= known:  # all on its way from the running step (an async decode)
            tokens = _PLACEHOLDER if n == 1 else (PLACEHOLDER,) * n
        else:                # the last token is still on its way from the running step
            tokens = tuple(seq.token_ids[start:end]) + (PLACEHOLDER,) * (end - known)
        last = end == known + seq.num_pending
        seq.num_computed = end
        if last:
            seq.num_pending += 1
        return SeqChunk(seq.id, tokens, start, seq.table_t, last)

    def _draft_chunk(self, seq: Sequence, drafts: tuple[int, ...]) -> SeqChunk:
        chunk = super()._draft_chunk(seq, drafts)
        seq.num_pending += 1
        return chunk

    def _float_chunk(self, seq: Sequence, k: int) -> SeqChunk:
        """A decode of a sequence with a step in flight, planned now: the last token (on
        its way) and k drafts, all DRAFTs the runner fills (the token, then prompt lookup
        over the sequence as the runner knows it), at the position where the KV ends if
        every draft in flight holds; the runner starts it where the KV really ends, and
        update counts it from there (seq.num_done)."""
        start = seq.num_computed
        n = 1 + k
        seq.num_computed = start + n
        seq.in_flight_tokens += n
        seq.in_flight_drafts += k
        seq.num_pending += 1
        self.num_floated += 1
        return SeqChunk(seq.id, (DRAFT,) * n, start, seq.table_t, True, k, floating=True)

    def _unplan(self, chunks, planned, seq: Sequence) -> SeqChunk | None:
        chunk = super()._unplan(chunks, planned, seq)
        if chunk is not None and chunk.sample:
            seq.num_pending -= 1
        return chunk

    def _token_came_back(self, seq: Sequence) -> None:
        seq.num_pending -= 1
