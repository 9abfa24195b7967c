"""Speculative decoding's part of scheduling (the drafter itself: drafter.py): which decodes
carry drafts, how many, and the counts of what the verifying steps accepted.

Drafts need the sequence's last token, so a sequence gets them only with no step in flight
for it (EngineConfig turns async scheduling off with speculation, so that is every decode).
The scheduler plans the chunk and, once verified, rolls the rejected drafts' KV back.
"""
from __future__ import annotations

import time

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
    """Whether a step drafts, and which drafts, from what steps measured: "never slower
    than off".

    Decode steps are told apart by their batch size (buckets of powers of two: 1, 2-3,
    4-7, ...). Per bucket the gate keeps two things, from the runner's measured step time
    (which holds the verify pass, the draft model's forwards and the acceptance):

    - the tokens per second that pure decode steps yielded with drafts and without
      (moving averages), and drafts when that with drafts is at least as high. Each mode
      is tried `WARM` times in a bucket before the figures decide, and the mode not chosen
      is tried again one step in `EXPLORE`, so that a change is seen;
    - a line fitted to the step's time against its rows (T = a + c * rows, moving
      averages over the steps with drafts and without). A draft row costs c; an off step
      yields n tokens in a + c * n, so a draft row pays only if it yields at least
      `threshold` = c * n / (a + c * n) tokens on average. Memory-bound (a large) that is
      near 0, and every draft pays; compute-bound (a small: 32 streams on a CPU) it nears
      1, and only drafts that nearly always hold do. Speculation drafts each sequence's
      j-th token only where its measured acceptance q gives q**j >= threshold
      (`draft_len`), so at one stream a sequence that copies drafts K tokens and at 32 a
      batch drafts little or nothing.

    In its warm-up a bucket drafts for at most a quarter of its sequences (`warm_cap`),
    so that measuring costs little where drafts lose. vLLM's disable_by_batch_size is one
    fixed threshold for every model, device and text."""

    WARM = 3
    EXPLORE = 24
    ALPHA = 0.25
    FIT = 0.15          # the line's moving averages' weight of a new step

    def __init__(self) -> None:
        # bucket -> [rate with drafts, rate without, steps with, steps without, decisions]
        self.buckets: dict[int, list[float]] = {}
        # bucket -> the line's moving sums [weight, rows, time, rows^2, rows*time]
        self.fits: dict[int, list[float]] = {}

    def _bucket(self, n: int) -> list[float]:
        b = self.buckets.get(n.bit_length())
        if b is None:
            b = self.buckets[n.bit_length()] = [0.0, 0.0, 0, 0, 0]
        return b

    def decide(self, num_running: int) -> bool:
        on = self.would_decide(num_running)
        self._bucket(num_running)[4] += 1
        return on

    def would_decide(self, num_running: int) -> bool:
        """What the next `decide` will say, without counting a decision."""
        b = self.buckets.get(num_running.bit_length())
        if b is None:
            return True
        if b[2] < self.WARM or b[3] < self.WARM:
            return b[2] <= b[3]         # alternate until both are measured
        on = b[0] >= b[1]
        return (not on) if (b[4] + 1) % self.EXPLORE == 0 else on

    def warm_cap(self, num_running: int) -> int | None:
        """How many sequences may draft in this step (None: no cap): a quarter of them
        while the bucket's line is not fitted."""
        return None if self.threshold(num_running) is not None else max(1, num_running // 4)

    def threshold(self, num_running: int) -> float | None:
        """The tokens a draft row must yield on average to pay (module docstring); None
        while the rows' cost is not measured in this bucket."""
        f = self.fits.get(num_running.bit_length())
        if f is None or f[0] <= 0:
            return None
        w, sx, sy, sxx, sxy = f
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < 0.25:          # rows too alike to tell a row's cost from the step's
            return None
        c = max(0.0, (sxy / w - mx * my) / var)
        a = max(0.0, my - c * mx)
        off = a + c * num_running
        return c * num_running / off if off > 0 else None

    def observe(self, num_seqs: int, drafted: bool, tokens: int, seconds: float,
                rows: int | None = None) -> None:
        """A pure decode step of num_seqs sequences (and `rows` rows, drafts included)
        yielded `tokens` in `seconds`."""
        if seconds <= 0 or num_seqs <= 0:
            return
        b = self._bucket(num_seqs)
        i = 0 if drafted else 1
        rate = tokens / seconds
        b[i] = rate if b[i + 2] == 0 else b[i] + self.ALPHA * (rate - b[i])
        b[i + 2] += 1
        x = float(rows if rows is not None else num_seqs)
        f = self.fits.setdefault(num_seqs.bit_length(), [0.0] * 5)
        keep = 1.0 - self.FIT
        for j, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            f[j] = f[j] * keep + v

    def preferred(self, num_running: int) -> bool | None:
        """What the figures say for this batch size (None: not measured yet): for tests."""
        b = self.buckets.get(num_running.bit_length())
        if b is None or b[2] < self.WARM or b[3] < self.WARM:
            return None
        return b[0] >= b[1]


def draft_len(q: float, threshold: float, k: int) -> int:
    """The drafts worth verifying for a sequence whose drafts hold with probability q each:
    the j-th yields a token only if all before it held (q**j), and pays if that is at
    least `threshold`."""
    if threshold <= 0:
        return k
    j, p = 0, 1.0
    while j < k:
        p *= q
        if p < threshold:
            break
        j += 1
    return j


class Speculation:
    """Drafts for decodes, up to `k` each, from `drafter`; off for a step whose batch has
    `disable_by_batch_size` running sequences or more (compute-bound: verifying costs real
    work), and, with `gate`, off for a step where the gate's measurements say drafts lose,
    and per sequence no longer than its measured acceptance pays for (CostGate).
    `counters` add up what the steps verified."""

    PRIOR = 2.0      # a sequence's acceptance starts as this many passes at the global rate

    def __init__(self, drafter: Drafter, k: int, disable_by_batch_size: int | None,
                 counters: SpecCounters, gate: CostGate | None = None) -> None:
        self.drafter = drafter
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.counters = counters
        self.gate = gate
        self.held: dict[str, list[int]] = {}   # seq id -> [drafts that held, that did not]
        self.total = [0, 0]                    # the same over every sequence
        self._threshold = 0.0                  # this step's (CostGate.threshold)
        self._cap: int | None = None           # sequences that may still draft this step
        self._last_result: float | None = None  # when the last step's result came

    def on_for(self, num_running: int) -> bool:
        """Whether this step drafts at all (and, with the gate, the step's threshold)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return False
        if self.gate is None:
            return True
        if not self.gate.decide(num_running):
            return False
        t = self.gate.threshold(num_running)
        self._threshold = 0.0 if t is None else t
        self._cap = self.gate.warm_cap(num_running)
        return True

    def would_draft(self, num_running: int) -> bool:
        """Whether the next step's `on_for` will let it draft (AsyncScheduler: such a step
        waits for the running one instead of being planned ahead)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return False
        return self.gate is None or self.gate.would_decide(num_running)

    def acceptance(self, seq_id: str) -> float:
        """The probability that a draft of this sequence holds, from its verify passes
        (each: the drafts that held, then at most one that did not) and, to start, the
        global rate."""
        ok, bad = self.total
        prior = (ok + 1) / (ok + bad + 2)
        h = self.held.get(seq_id)
        if h is None:
            return prior
        return (h[0] + self.PRIOR * prior) / (h[0] + h[1] + self.PRIOR)

    def observe(self, plan, result) -> None:
        """A step's result, for the gate: a step of decodes only (one token each, or a
        verify pass) is measured; a step with prompt chunks is not a decode step's cost.
        Its cost is the wall time since the result before it (what the step cost the
        engine: a step planned ahead overlaps the host's work, a drafting step waits for
        it), or the runner's time where that interval spans an idle wait."""
        now = time.monotonic()
        last, self._last_result = self._last_result, now
        if self.gate is None or not plan.chunks:
            return
        rows = 0
        for c in plan.chunks:
            if not c.sample or len(c.token_ids) != 1 + c.num_drafts:
                return
            rows += len(c.token_ids)
        drafted = rows > len(plan.chunks)
        tokens = sum(result.num_tokens) if result.num_tokens else len(result.token_ids)
        seconds = result.duration_s
        if last is not None and seconds <= now - last <= 3 * seconds + 0.002:
            seconds = now - last
        self.gate.observe(len(plan.chunks), drafted, tokens, seconds, rows)

    def drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Drafts for a decode of one token: at most k, what the length limit leaves after
        the bonus token, what the step's token budget leaves after the decode, and (with
        the gate) what the sequence's acceptance pays for."""
        if seq.num_pending or seq.req.sampling.options.thinking_token_budget is not None:
            return ()      # its last token is not known yet / a budget forces tokens one by one
        # (a grammar does not stop drafting: the runner masks each verify row with the
        # grammar walked through the drafts before it, gpu/grammar.py draft_masks)
        k = min(self.k, stop.tokens_left(seq, len(seq.token_ids)) - 1, budget - 1)
        if self.gate is not None and k > 0:
            if self._cap is not None and self._cap <= 0:
                return ()
            k = draft_len(self.acceptance(seq.id), self._threshold, k)
        if k <= 0:
            return ()
        drafts = self.drafter.propose(seq.id, seq.token_ids, k)
        if drafts and self._cap is not None:
            self._cap -= 1
        return drafts

    def verified(self, seq: Sequence, drafts: int, accepted: int) -> None:
        self.counters.count(drafts, accepted)
        seq.spec_drafts += 1
        seq.spec_draft_tokens += drafts
        seq.spec_accepted += accepted
        h = self.held.setdefault(seq.id, [0, 0])
        miss = 1 if accepted < drafts else 0
        h[0] += accepted
        h[1] += miss
        self.total[0] += accepted
        self.total[1] += miss

    def forget(self, seq_id: str) -> None:
        self.drafter.forget(seq_id)
        self.held.pop(seq_id, None)


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
