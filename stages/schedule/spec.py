"""Speculative decoding's part of scheduling (the drafter itself: drafter.py): which decodes
carry drafts, how many, and the counts of what the verifying steps accepted.

Drafts need the sequence's last token, so a sequence gets them only with no step in flight
for it (EngineConfig turns async scheduling off with speculation, so that is every decode).
The scheduler plans the chunk and, once verified, rolls the rejected drafts' KV back.
"""
from __future__ import annotations

from gpu.interface import StepResult, TokenLogprobs
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


class CostGate:
    """Whether a step drafts, from what steps measured: "never slower than off".

    Decode steps are told apart by their batch size (buckets of powers of two: 1, 2-3,
    4-7, ...). In each bucket the gate keeps the tokens per second that pure decode steps
    yielded with drafts and without (moving averages of tokens out over the runner's
    measured step time: the verify pass's cost, the draft model's forwards, and the
    acceptance, all in one figure), and drafts when that with drafts is at least as high.
    Each mode is tried `WARM` times in a bucket before the figures decide, and the mode
    not chosen is tried again one step in `EXPLORE`, so that a change (longer contexts,
    text that copies less) is seen; so where drafts lose, the gate pays for it on one step
    in EXPLORE. vLLM's disable_by_batch_size is one fixed threshold for every model,
    device and text."""

    WARM = 3
    EXPLORE = 24
    ALPHA = 0.25

    def __init__(self) -> None:
        # bucket -> [rate with drafts, rate without, steps with, steps without, decisions]
        self.buckets: dict[int, list[float]] = {}

    def _bucket(self, n: int) -> list[float]:
        b = self.buckets.get(n.bit_length())
        if b is None:
            b = self.buckets[n.bit_length()] = [0.0, 0.0, 0, 0, 0]
        return b

    def decide(self, num_running: int) -> bool:
        b = self._bucket(num_running)
        b[4] += 1
        if b[2] < self.WARM or b[3] < self.WARM:
            return b[2] <= b[3]         # alternate until both are measured
        on = b[0] >= b[1]
        return (not on) if b[4] % self.EXPLORE == 0 else on

    def observe(self, num_seqs: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A pure decode step of num_seqs sequences yielded `tokens` in `seconds`."""
        if seconds <= 0 or num_seqs <= 0:
            return
        b = self._bucket(num_seqs)
        i = 0 if drafted else 1
        rate = tokens / seconds
        b[i] = rate if b[i + 2] == 0 else b[i] + self.ALPHA * (rate - b[i])
        b[i + 2] += 1

    def preferred(self, num_running: int) -> bool | None:
        """What the figures say for this batch size (None: not measured yet): for tests."""
        b = self.buckets.get(num_running.bit_length())
        if b is None or b[2] < self.WARM or b[3] < self.WARM:
            return None
        return b[0] >= b[1]


class Speculation:
    """Drafts for decodes, up to `k` each, from `drafter`; off for a step whose batch has
    `disable_by_batch_size` running sequences or more (compute-bound: verifying costs real
    work), and, with `gate`, off for a step where the gate's measurements say drafts lose.
    `counters` add up what the steps verified."""

    def __init__(self, drafter: Drafter, k: int, disable_by_batch_size: int | None,
                 counters: SpecCounters, gate: CostGate | None = None) -> None:
        self.drafter = drafter
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.counters = counters
        self.gate = gate

    def on_for(self, num_running: int) -> bool:
        """Whether this step drafts at all."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return False
        return self.gate is None or self.gate.decide(num_running)

    def observe(self, plan, result) -> None:
        """A step's result, for the gate: a step of decodes only (one token each, or a
        verify pass) is measured; a step with prompt chunks is not a decode step's cost."""
        if self.gate is None or not plan.chunks:
            return
        for c in plan.chunks:
            if not c.sample or len(c.token_ids) != 1 + c.num_drafts:
                return
        drafted = any(c.num_drafts for c in plan.chunks)
        tokens = sum(result.num_tokens) if result.num_tokens else len(result.token_ids)
        self.gate.observe(len(plan.chunks), drafted, tokens, result.duration_s)

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


def step_outputs(result: StepResult) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple]]:
    """A step's result by sequence id: its tokens, and their logprobs (an empty dict when
    none asked). One token each, or result.num_tokens each when the step verified drafts."""
    sids = result.seq_ids
    if not result.num_tokens:
        return (dict(zip(sids, zip(result.token_ids))),
                dict(zip(sids, zip(result.logprobs))) if result.logprobs else {})
    tokens, logprobs, at = {}, {}, 0
    for sid, n in zip(sids, result.num_tokens):
        tokens[sid] = result.token_ids[at:at + n]
        if result.logprobs:
            logprobs[sid] = result.logprobs[at:at + n]
        at += n
    return tokens, logprobs


def kept_logprobs(lps: tuple[TokenLogprobs | None, ...], kept: int) -> tuple[TokenLogprobs, ...]:
    """The kept tokens' logprobs: all of them, or none if the sequence did not ask."""
    lps = lps[:kept]
    return () if any(lp is None for lp in lps) else lps
