"""Speculative decoding's part of the scheduler's planning (a mixin of Scheduler, as
beam_side.py and kv.py are): a decode's chunk with drafts, a floating chunk behind a verify
pass in flight (async_.py), and the rollback of a verified chunk's rejected drafts.
spec.py decides how many drafts; this plans them into the step."""
from __future__ import annotations

from gpu.interface import SeqChunk
from stages.schedule.sequence import Sequence


class SpecSide:
    # AsyncScheduler with runner-filled floating chunks, which defines _float_chunk
    # (async_.py): the plain Scheduler never plans with a step in flight
    floating = False

    def _decodes_only(self, running: list[Sequence]) -> bool:
        """Whether the step planned now is to carry no prompt chunk (the cost gate measures
        only such steps, spec.py CostGate.would_decide): no waiting request that could be
        admitted, and no running sequence with more than its next token to compute."""
        if self.waiting and len(running) < self.max_num_seqs:
            return False
        floating = self.floating
        for seq in running:
            total = len(seq.token_ids) + seq.num_pending + (seq.in_flight_drafts if floating else 0)
            if total - seq.num_computed > 1:
                return False
        return True

    def _drafted_chunk(self, seq: Sequence, spec, budget: int) -> SeqChunk | None:
        """A decode of one token with drafts, if it gets any and its blocks fit (None: a
        plain decode, planned by the caller): a floating chunk for a sequence with a step
        in flight (the gate's count, the runner's lookup), else the drafter's drafts."""
        bs = self.blocks.block_size
        if self.floating and seq.num_pending:
            k = spec.float_drafts(seq, budget)
            if k and (seq.num_computed + 1 + k <= len(seq.table) * bs or self._grow(seq, 1 + k)):
                return self._float_chunk(seq, k)
            spec.unplanned(k)
            return None
        drafts = spec.drafts(seq, budget)
        if drafts and (seq.num_computed + 1 + len(drafts) <= len(seq.table) * bs
                       or self._grow(seq, 1 + len(drafts))):
            return self._draft_chunk(seq, drafts)
        return None

    def _draft_chunk(self, seq: Sequence, drafts: tuple[int, ...]) -> SeqChunk:
        """Plan a decode with drafts: the last token and the drafts, all sampled; the drafts
        count as computed until the result says which were accepted (update rolls back)."""
        start = seq.num_computed
        tokens = (seq.token_ids[-1], *drafts)
        seq.num_computed = start + len(tokens)
        seq.in_flight_tokens += len(tokens)
        seq.in_flight_drafts += len(drafts)
        return SeqChunk(seq.id, tokens, start, seq.table_t, True, len(drafts))

    def _rollback(self, seq: Sequence, done: int) -> None:
        """A verified chunk kept the KV of `done` tokens: the rejected drafts' positions
        are computed again (overwritten), and the blocks that hold nothing but rejected
        positions past the next token's (and the chunks still in flight) are freed (they
        never got a hash)."""
        seq.num_computed = done = done + seq.in_flight_tokens
        keep = self.blocks.blocks_for(done + 1)
        if len(seq.table) > keep:
            tail = seq.table[keep:]
            del seq.table[keep:]
            seq.table_t = tuple(seq.table)
            self.blocks.release(tail)

