"""Speculative decoding's part of the scheduler's planning (`SpecPlanning`, an object
`Scheduler` holds as `spec_planning`, as it holds `beam_search` and `kv`): whether a step
carries only decodes, a decode's chunk with drafts or a floating chunk behind a verify
pass in flight (async_.py), and the rollback of a verified chunk's rejected drafts.
spec.py decides how many drafts; this plans them into the step. The chunks themselves
are the scheduler's to make (`_draft_chunk`, `_float_chunk`: AsyncScheduler's own)."""
from __future__ import annotations

from gpu.interface import SeqChunk
from stages.schedule.sequence import Sequence


class SpecPlanning:
    def __init__(self, sched) -> None:
        self.sched = sched

    def decodes_only(self, running: list[Sequence]) -> bool:
        """Whether the step planned now is to carry no prompt chunk (the cost gate measures
        only such steps, spec.py CostGate.would_decide): no waiting request that could be
        admitted, and no running sequence with more than its next token to compute."""
        s = self.sched
        if s.waiting and len(running) < s.max_num_seqs:
            return False
        floating = s.floating
        for seq in running:
            total = len(seq.token_ids) + seq.num_pending + (seq.in_flight_drafts if floating else 0)
            if total - seq.num_computed > 1:
                return False
        return True

    def drafted_chunk(self, seq: Sequence, spec, budget: int) -> SeqChunk | None:
        """A decode of one token with drafts, if it gets any and its blocks fit (None: a
        plain decode, planned by the caller): a floating chunk for a sequence with a step
        in flight (the gate's count, the runner's lookup), else the drafter's drafts."""
        s = self.sched
        bs = s.blocks.block_size
        if s.floating and seq.num_pending:
            k = spec.float_drafts(seq, budget)
            if k and (seq.num_computed + 1 + k <= len(seq.table) * bs or s._grow(seq, 1 + k)):
                return s._float_chunk(seq, k)
            spec.unplanned(k)
            return None
        drafts = spec.drafts(seq, budget)
        if drafts and (seq.num_computed + 1 + len(drafts) <= len(seq.table) * bs
                       or s._grow(seq, 1 + len(drafts))):
            return s._draft_chunk(seq, drafts)
        return None

    def rollback(self, seq: Sequence, done: int) -> None:
        """A verified chunk kept the KV of `done` tokens: the rejected drafts' positions
        are computed again (overwritten), and the blocks that hold nothing but rejected
        positions past the next token's (and the chunks still in flight) are freed (they
        never got a hash)."""
        seq.num_computed = done = done + seq.in_flight_tokens
        blocks = self.sched.blocks
        keep = blocks.blocks_for(done + 1)
        if len(seq.table) > keep:
            tail = seq.table[keep:]
            del seq.table[keep:]
            seq.table_t = tuple(seq.table)
            blocks.release(tail)
