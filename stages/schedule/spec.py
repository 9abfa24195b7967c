"""Speculative decoding's part of scheduling (the drafter itself: drafter.py): which decodes
carry drafts, how many, and the counts of what the verifying steps accepted.

Drafts need the sequence's last token, so a sequence gets them only with no step in flight
for it (EngineConfig turns async scheduling off with speculation, so that is every decode).
The scheduler plans the chunk and, once verified, rolls the rejected drafts' KV back.
"""
from __future__ import annotations

from stages.schedule import stop
from stages.schedule.drafter import Drafter
from stages.schedule.sequence import Sequence


class SpecCounters:
    """Speculative decoding's totals since start (vLLM's spec_decode counters)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0             # verify passes: sequences that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k   # [i]: drafts accepted at position i

    def count(self, drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class Speculation:
    """Drafts for decodes, up to `k` each, from `drafter`; off for a step whose batch has
    `disable_by_batch_size` running sequences or more (compute-bound: verifying costs real
    work). `counters` add up what the steps verified."""

    def __init__(self, drafter: Drafter, k: int, disable_by_batch_size: int | None,
                 counters: SpecCounters) -> None:
        self.drafter = drafter
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.counters = counters

    def on_for(self, num_running: int) -> bool:
        """Whether this step drafts at all."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Drafts for a decode of one token: at most k, what the length limit leaves after
        the bonus token, and what the step's token budget leaves after the decode."""
        if (seq.num_pending or seq.grammar is not None
                or seq.req.sampling.options.thinking_token_budget is not None):
            return ()      # its last token is not known yet / a grammar or a budget checks every token
        k = min(self.k, stop.tokens_left(seq, len(seq.token_ids)) - 1, budget - 1)
        return self.drafter.propose(seq.id, seq.token_ids, k) if k > 0 else ()

    def verified(self, seq: Sequence, drafts: int, accepted: int) -> None:
        self.counters.count(drafts, accepted)
        seq.spec_drafts += 1
        seq.spec_draft_tokens += drafts
        seq.spec_accepted += accepted

    def forget(self, seq_id: str) -> None:
        self.drafter.forget(seq_id)
