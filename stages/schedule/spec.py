"""Speculative decoding's part of scheduling (the drafter itself: drafter.py): which decodes
carry drafts, how many, and the counts of what the verifying steps accepted.

Drafts need the sequence's last token, so a sequence gets them with no step in flight
for it, or (async scheduling) as a floating chunk whose drafts the runner fills (async_.py).
The scheduler plans the chunk and, once verified, rolls the rejected drafts' KV back.
"""
from __future__ import annotations

import time
from typing import Callable

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
    """Whether a step drafts, and how many draft rows it verifies, from what steps measured:
    "never slower than off".

    Decode steps are told apart by their batch size (buckets of powers of two: 1, 2-3,
    4-7, ...). Per bucket the gate keeps, from each pure decode step's measured time (the
    wall time between results: the verify pass, the draft model's forwards, the acceptance
    and, for a drafting step, the lost overlap with the host's work):

    - the tokens per second that steps yielded with drafts and without (each mode's last
      `WINDOW` steps, less any that took over `STALL` x the median: a passing stall, each
      weighing half as much `HALF` steps later): the direct A/B. Each mode is tried `WARM`
      times in a bucket; then, where drafting measured slower than off, no step drafts,
      whatever the costs below expect, and the mode not chosen is tried again one step in
      `EXPLORE` where the two rates are far apart, more often the closer they are
      (`_every`: a close call is cheap to measure again, and it is the call a stale rate
      turns), and in a quarter of EXPLORE where the costs expect a gain the A/B does not
      show, while it holds few drafting steps, or where the gain expected is large, so
      that a change is seen;
    - the time of a drafting step by its rows (`costs`: bins of a quarter of the bucket's
      smallest batch, each the median of its last `KEEP` steps), measured, not fitted: a
      step's cost is not one line in its rows (the CPU's packed kernels hand over to
      dequantize + GEMM past a row limit, a GPU's graphs come in sizes), so a step at
      n + m rows is priced at what steps of that many rows cost.

    A step the A/B lets draft (`rows`) gives its m draft rows to the drafts worth most: the
    j-th draft of a sequence whose drafts hold with probability q yields q**j tokens (each
    rejected row costs its row all the same), and m is the count that makes the expected
    (n + the m best values) / T(n + m) the highest, if that is `MARGIN` over the off rate
    (else the step does not draft). Rows past the largest measured are priced from the
    slope of the last two measured bins (flat from one) and tried one bin at a time; one
    drafting step in `EXPLORE` tries the bin above the best, so that a bin measured under
    a passing load is measured again. At one stream (memory-bound) that drafts K tokens where text copies;
    at 32 on a CPU it drafts the best sequences up to the rows that stay cheap, or nothing.
    vLLM's disable_by_batch_size is one fixed threshold for every model, device and text."""

    WARM = 3
    EXPLORE = 24
    WINDOW = 8          # a mode's rate: its last WINDOW steps (the A/B)
    ALPHA = 0.25        # a bin's rows: a moving average's weight of a new step
    MARGIN = 0.05       # the gain, over off, that drafting must show (measured or expected)
    BONUS = 0.1         # a bin's rate's benefit of the doubt, over the root of its steps
    KEEP = 5            # a bin's time: the median of its last KEEP steps
    PROBE_GAP = 0.5     # the A/B's rates this far apart (50%): the other mode 1 in EXPLORE
    PROBE_MIN = 4       # ... and close: 1 in PROBE_MIN
    STALL = 1.5         # a step over STALL x its window's median is a stall, not a rate
    HALF = 8            # a window's step weighs half as much HALF decisions later
    STALE = 192         # decisions without a drafting step: a probe may start a sequence
    VETOED = 4          # drafts far slower than off: probed down to one in VETOED x EXPLORE
    PROBE_COST = 0.005  # a draft model's vetoed drafts' probes: at most this share of the time

    def __init__(self, probe_cost: float | None = None) -> None:
        # vetoed drafts' probes kept under this share of the time (`_every`): for a draft
        # model, whose probes cost its K forwards (Speculation sets PROBE_COST). n-gram
        # lookup's probes draft only for the sequences that copy best, which may well pay as
        # they are measured, so they keep the close-call rate
        self.probe_cost = probe_cost
        # bucket -> [rate with drafts, rate without, steps with, steps without, decisions,
        #            the last WINDOW steps with, without: (seconds, tokens, decision, rows)]
        self.buckets: dict[int, list[float]] = {}
        # bucket -> {rows // width: [seconds (median), rows (moving average), steps, the
        # last KEEP steps' seconds]}, of drafting steps
        self.costs: dict[int, dict[int, list[float]]] = {}
        self.expected = 1.0     # the last `rows`' expected rate over off's
        self.probing = False    # the last `decide`: drafts the A/B does not back

    @staticmethod
    def width(n: int) -> int:
        """The rows per bin of a cost table in n's bucket (a quarter of its smallest batch)."""
        return max(1, (1 << max(0, n.bit_length() - 1)) // 4)

    def _bucket(self, n: int) -> list[float]:
        b = self.buckets.get(n.bit_length())
        if b is None:
            b = self.buckets[n.bit_length()] = [0.0, 0.0, 0, 0, 0, [], []]
        return b

    def decide(self, num_running: int, pure: bool = True) -> bool:
        """pure: the step is to be one of decodes only, which `observe` measures (else it
        carries prompt chunks: the decision is not counted, see would_decide)."""
        on = self.would_decide(num_running, pure)
        b = self._bucket(num_running)
        if not pure:
            self.probing = False
            return on
        b[4] += 1
        # a drafting step the A/B does not back: the warm-up's, or a probe of vetoed drafts
        self.probing = on and not (b[2] >= self.WARM and b[3] >= self.WARM and b[0] >= b[1])
        return on

    def may_start(self, num_running: int) -> bool:
        """Whether a probe may draft for a sequence the draft model has not followed (one
        that must first catch its draft KV up: a prompt's prefill in the draft): in the
        warm-up, or where no drafting step was measured for STALE decisions, unless the
        drafting steps measured far slower than off even had every draft held (`ceiling`:
        a draft model as costly as the target): then no sequence's acceptance, however
        high, turns the call, and its catch-up would be paid for nothing."""
        b = self.buckets.get(num_running.bit_length())
        if b is None or b[2] < self.WARM or not b[5]:
            return True
        if b[3] >= self.WARM and self.ceiling(num_running) * (1 + self.PROBE_GAP) < b[1]:
            return False
        return b[4] - b[5][-1][2] >= self.STALE

    def ceiling(self, num_running: int) -> float:
        """The tokens per second this bucket's drafting steps (its A/B window) would have
        yielded had every draft held: their rows over their time (0: none measured)."""
        b = self.buckets.get(num_running.bit_length())
        steps = b[5] if b is not None else ()
        seconds = sum(s for s, _, _, _ in steps)
        return sum(r for _, _, _, r in steps) / seconds if seconds > 0 else 0.0

    def would_decide(self, num_running: int, pure: bool = True) -> bool:
        """What the next `decide` will say (the A/B), without counting a decision. A step
        with prompt chunks (not pure) is not measured, so it drafts only where the A/B
        prefers drafts: no warm-up or probe is spent on it (a bucket that only ever sees
        such steps, requests arriving between waves, would else stay in its warm-up and
        draft every other step unmeasured)."""
        b = self.buckets.get(num_running.bit_length())
        if not pure:
            return (b is not None and b[2] >= self.WARM and b[3] >= self.WARM and b[0] >= b[1])
        if b is None:
            return True
        if b[2] < self.WARM or b[3] < self.WARM:
            return b[2] <= b[3]         # alternate until both are measured
        at = b[4] + 1
        every = self._every(b)
        if b[0] >= b[1]:            # the A/B vetoes drafts that measured slower
            return at % every != 0
        # ... and tries them again one step in `every`, or in a quarter of EXPLORE where the
        # costs expect a gain the A/B does not show (it may be stale: text changes) and
        # the A/B holds few drafting steps yet, or where they expect a large one
        e = self.expected
        fast = e >= 1 + 4 * self.MARGIN or (e >= 1 + self.MARGIN and len(b[5]) < self.WINDOW)
        return at % (min(every, self.EXPLORE // 4) if fast else every) == 0

    def _every(self, b: list) -> int:
        """Steps between two probes of the mode the A/B did not choose. Off, where drafts
        are preferred: one in EXPLORE where the two rates are `PROBE_GAP` apart or more, down
        to one in `PROBE_MIN` where they are close: a close call is the one a stale rate
        turns, and a few slow steps of off (another process's load) would otherwise hold
        drafting on for EXPLORE steps a probe. Vetoed drafts: as often, and those far slower
        than off (a draft model as costly as the target) less often still, down to one in
        VETOED x EXPLORE; with `probe_cost` (a draft model) never so often that their probes,
        each costing the gap, take more than that share of the time."""
        lo, hi = sorted((b[0], b[1]))
        gap = hi / lo - 1 if lo > 0 else 1.0
        every = round(self.EXPLORE * gap / self.PROBE_GAP)
        if b[0] < b[1]:
            # (past EXPLORE a multiple of it: `rows` offers a vetoed bucket its first bin one
            # step in EXPLORE). Drafts the A/B prefers are probed against off as above, so
            # that a stale rate lets go of them soon.
            if self.probe_cost:
                every = max(every, round(gap / self.probe_cost))
                if every > self.EXPLORE:
                    return self.EXPLORE * min(self.VETOED, -(-every // self.EXPLORE))
            elif gap > self.PROBE_GAP:
                return self.EXPLORE * min(self.VETOED, round(gap / self.PROBE_GAP))
        return max(self.PROBE_MIN, min(self.EXPLORE, every))

    def _cost(self, bins: dict[int, list[float]], at: int, t_off: float | None,
              n: int) -> float | None:
        """A drafting step's time in bin `at`: the least measured in it or above (a step of
        fewer rows costs no more: noise does not turn drafts down); past the largest, the last two
        measured bins' slope (flat from one: what drafting adds to an off step, the lost
        overlap and the verify's own work, is not a row's cost); None: not to be tried."""
        above = [bins[k][0] for k in bins if k >= at]
        if above:       # a step costs no more than one of more rows measured
            return min(above)
        if at > (max(bins) + 1 if bins else (n + 1) // self.width(n)):
            return None                 # one bin past the measured at a time
        pts = [(bins[k][1], bins[k][0]) for k in sorted(bins)[-2:]] or [(float(n), t_off)]
        if pts[0][1] is None:
            return None
        x1, t1 = pts[-1]
        slope = 0.0 if len(pts) < 2 or pts[1][0] <= pts[0][0] else max(
            0.0, (pts[1][1] - pts[0][1]) / (pts[1][0] - pts[0][0]))
        return t1 + slope * max(0.0, (at + 0.5) * self.width(n) - x1)

    def rows(self, num_running: int, values: list[float]) -> int:
        """The draft rows the next step (the next `decide`'s) verifies if it drafts (0:
        none), given the expected tokens of each draft it could carry, highest first (class
        docstring); `expected` keeps the expected rate over off's."""
        n = num_running
        self.expected = 1.0
        if n <= 0 or not values:
            return 0
        key = n.bit_length()
        b = self.buckets.get(key)
        bins = self.costs.get(key, {})
        off_rate = b[1] if b is not None and b[3] else 0.0
        t_off = n / off_rate if off_rate > 0 else None
        w = self.width(n)
        if t_off is None and not bins:  # nothing measured: try the first bin
            return min(len(values), ((n + 1) // w + 1) * w - 1 - n)
        # in the warm-up (fewer than WARM drafting steps) the best bin drafts, whatever off
        floor = 0.0 if b is None or b[2] < self.WARM else off_rate * (1 + self.MARGIN)
        best, best_rate, best_bin = 0, 0.0, None
        last: dict[int, int] = {}       # bin -> the most rows m in it
        tokens = float(n)
        for m, v in enumerate(values, 1):
            if v <= 0:
                break
            tokens += v
            at = (n + m) // w
            last[at] = m
            if m < len(values) and (n + m + 1) // w == at and values[m] > 0:
                continue                # the bin's last m only: the same cost, more tokens
            t = self._cost(bins, at, t_off, n)
            if t is None:
                break                   # past what may be tried (its last m is kept)
            if t > 0 and tokens / t > floor:
                # a bin measured less often gets the benefit of the doubt (BONUS), so that a
                # close call is measured again; against off, only the measured rate counts
                seen = bins[at][2] if at in bins else 0
                rate = tokens / t * (1 + self.BONUS / min(8, 1 + seen) ** 0.5)
                if rate > best_rate:
                    best, best_rate, best_bin = m, rate, at
                    self.expected = tokens / t / off_rate if off_rate > 0 else 1.0
        step = 0 if b is None else b[4] + 1
        if best and step % self.EXPLORE == self.EXPLORE // 2:
            best = last.get(best_bin + 1, best)     # measure the bin above again
        elif not best and step % self.EXPLORE == 0 and b is not None:
            best = last.get((n + 1) // w, 0)        # the A/B's probe: the first bin
        return best

    def observe(self, num_seqs: int, drafted: bool, tokens: int, seconds: float,
                rows: int | None = None) -> None:
        """A pure decode step of num_seqs sequences (and `rows` rows, drafts included)
        yielded `tokens` in `seconds`."""
        if seconds <= 0 or num_seqs <= 0:
            return
        b = self._bucket(num_seqs)
        i = 0 if drafted else 1
        window = b[5 + i]
        at = b[4]
        window.append((seconds, tokens, at, rows if rows is not None else tokens))
        if len(window) > self.WINDOW:
            del window[0]
        stall = self.STALL * sorted(window)[len(window) // 2][0]
        # older steps weigh less (half every HALF decisions in the bucket): a mode measured
        # only by probes follows its newest ones, not steps from before the other one ran
        kept = [(s, t, 0.5 ** ((at - a) / self.HALF)) for s, t, a, _ in window if s <= stall]
        b[i] = sum(t * w for _, t, w in kept) / sum(s * w for s, _, w in kept)
        b[i + 2] += 1
        if drafted:
            x = float(rows if rows is not None else num_seqs)
            c = self.costs.setdefault(num_seqs.bit_length(), {}).setdefault(
                int(x) // self.width(num_seqs), [seconds, x, 0, []])
            c[1] += self.ALPHA * (x - c[1])
            c[2] += 1
            last = c[3]
            last.append(seconds)
            if len(last) > self.KEEP:
                del last[0]
            c[0] = sorted(last)[(len(last) - 1) // 2]   # a median: a stall moves it little

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
    else as many draft rows as its measured costs pay for, given to the drafts most likely
    to hold by each sequence's measured acceptance (CostGate).
    `counters` add up what the steps verified."""

    PRIOR = 2.0      # a sequence's acceptance starts as this many passes at the global rate
    LAG = 48         # a probe drafts for a sequence the draft model saw this recently

    def __init__(self, drafter: Drafter, k: int, disable_by_batch_size: int | None,
                 counters: SpecCounters, gate: CostGate | None = None,
                 draft_cost: float | None = None) -> None:
        self.drafter = drafter
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.counters = counters
        self.gate = gate
        # a draft model's multiply-adds a token over the target's (None: not a draft model).
        # A drafting step runs k draft forwards and a verify that costs at least an off
        # step, for at most k + 1 tokens a sequence: at most (k + 1) / (1 + k r) of off's
        # rate had every draft held. Under the gate's MARGIN (a draft as large as the
        # target: SmolLM2 drafting for itself) no step can gain, so the gate drafts none
        # and pays no warm-up for it ("adaptive": false drafts all the same).
        self.draft_cost = draft_cost
        self.bound = None if draft_cost is None else (k + 1) / (1 + k * draft_cost)
        self.futile = gate is not None and self.bound is not None and self.bound < 1 + gate.MARGIN
        self.held: dict[str, list[int]] = {}   # seq id -> [drafts that held, that did not]
        self.total = [0, 0]                    # the same over every sequence
        self._threshold = 0.0                  # the value a draft needs this step (gate)
        self._cap: int | None = None           # draft rows this step may still carry (gate)
        self._last_result: float | None = None  # when the last step's result came
        # a drafter with state to catch up (a draft model's KV: gpu/worker/spec_decode/draft.py): seq id ->
        # its tokens when it last drafted, and the sequences this step's probe may draft for
        self.catches_up = bool(getattr(drafter, "catches_up", False))
        if gate is not None and self.catches_up:   # a probe costs the draft's forwards
            gate.probe_cost = gate.PROBE_COST
        self.seen: dict[str, int] = {}
        self._eligible: set[str] | None = None
        self._catching: set[str] = set()     # sequences whose next verify catches up

    def mode(self) -> str:
        """When steps draft, in words (the start-up log)."""
        if self.gate is None:
            return "every step"
        if self.futile:
            return (f"never: the draft model costs {self.draft_cost:.2f}x the target's multiply-adds "
                    f"a token, so a step with {self.k} drafts a sequence would be at most "
                    f"{self.bound:.2f}x as fast as one without had every draft held; use a "
                    f"smaller draft (\"adaptive\": false drafts at every step all the same)")
        return "decided per step from measured costs" + (
            "" if self.bound is None else f" (at most {self.bound:.2f}x had every draft held)")

    def on_for(self, running: list[Sequence], decodes_only: Callable[[], bool] | None = None) -> bool:
        """Whether this step drafts at all (and, with the gate, the step's draft rows and
        the value a draft must have to get one); decodes_only: whether no prompt chunk is to
        join the step (asked only where it matters; None: none is). With a
        draft model a step with prompt chunks drafts only where the gate prefers drafts (its
        K forwards are not cheap beside a prompt chunk, and the step is not measured); other
        drafts (n-gram lookup, an EAGLE head's one layer) add only verify rows to a step
        that a prompt chunk dominates, so such a step decides as a decode step does."""
        n = len(running)
        if self.disable_by_batch_size is not None and n >= self.disable_by_batch_size or self.futile:
            return False
        if self.gate is None:
            return True
        values = self._values(running)
        m = self.gate.rows(n, values)
        self._eligible = None
        if not self.gate.decide(n, self._pure(decodes_only)):
            return False
        self._threshold = values[m - 1] if m else 1.0
        self._cap = m
        if m and self.catches_up and self.gate.probing:
            self._eligible = self._probe_set(running, n)
            # the step's rows among those: their best drafts
            values = self._values([seq for seq in running if seq.id in self._eligible])
            m = min(m, len(values))
            self._threshold = values[m - 1] if m else 1.0
            self._cap = m
        return m > 0

    def _probe_set(self, running: list[Sequence], n: int) -> set[str]:
        """The sequences a probe (a drafting step the A/B does not back) may draft for,
        with a draft model: those it followed within LAG tokens, since any other's first
        drafts cost its draft KV's catch-up (its whole prompt, for a sequence that never
        drafted), which a probe would pay for a rate that may well be vetoed again. Where
        none is, the one it is nearest to, in the warm-up or when drafting has not been
        measured for a while (the gate's `may_start`), else none: the step does not draft."""
        lags = {seq.id: len(seq.token_ids) - self.seen.get(seq.id, 0) for seq in running}
        near = {sid for sid, lag in lags.items() if lag <= self.LAG}
        if near or not lags or not self.gate.may_start(n):
            return near
        return {min(lags, key=lags.get)}

    def _pure(self, decodes_only: Callable[[], bool] | None) -> bool:
        """Whether the gate decides this step as a decode step (on_for's docstring)."""
        return not self.catches_up or decodes_only is None or decodes_only()

    def would_draft(self, running: list[Sequence], decodes_only: Callable[[], bool] | None = None) -> bool:
        """Whether the next step's `on_for` will let it draft (AsyncScheduler: such a step
        waits for the running one instead of being planned ahead)."""
        n = len(running)
        if self.disable_by_batch_size is not None and n >= self.disable_by_batch_size or self.futile:
            return False
        if self.gate is None:
            return True
        # (the A/B first: it reads the last step's expectation, and costs nothing)
        return (self.gate.would_decide(n, self._pure(decodes_only))
                and self.gate.rows(n, self._values(running)) > 0)

    def _values(self, running: list[Sequence]) -> list[float]:
        """The expected tokens of each draft the running sequences could carry (q**j for a
        sequence's j-th, computed as draft_len does), highest first."""
        out: list[float] = []
        for seq in running:
            q, p = self.acceptance(seq.id), 1.0
            for _ in range(self.k):
                p *= q
                out.append(p)
        out.sort(reverse=True)
        return out

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
        engine: a step planned ahead overlaps the host's work, a drafting step planned
        without async scheduling waits for it), or the runner's time where that interval
        spans an idle wait. A floating step counts the drafts the runner filled."""
        now = time.monotonic()
        last, self._last_result = self._last_result, now
        if self.gate is None or not plan.chunks:
            return
        catching = False
        if self._catching:
            for c in plan.chunks:
                if c.num_drafts and c.seq_id in self._catching:
                    self._catching.discard(c.seq_id)
                    catching = True
        rows = 0
        for c in plan.chunks:
            if not c.sample or len(c.token_ids) != 1 + c.num_drafts:
                return
            rows += len(c.token_ids)
        if catching:       # a draft model's catch-up (a prompt, once): no step's cost
            return
        if result.num_drafts:    # floating chunks: the rows the runner's lookup filled
            rows = len(plan.chunks) + sum(result.num_drafts)
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
        if self._eligible is not None and seq.id not in self._eligible:
            return ()      # a probe's, for a sequence the draft model is far behind
        # (a grammar does not stop drafting: the runner masks each verify row with the
        # grammar walked through the drafts before it, gpu/worker/grammar.py draft_masks)
        k = min(self.k, stop.tokens_left(seq, len(seq.token_ids)) - 1, budget - 1)
        if self.gate is not None and k > 0:
            k = min(draft_len(self.acceptance(seq.id), self._threshold, k), self._cap or 0)
        if k <= 0:
            return ()
        drafts = self.drafter.propose(seq.id, seq.token_ids, k)
        if drafts and self._cap is not None:
            self._cap -= len(drafts)
        if drafts and self.catches_up:
            self._followed(seq)
        return drafts

    def _followed(self, seq: Sequence) -> None:
        """The sequence drafts in the step planned: the draft model catches up to it there
        (a catch-up past LAG tokens keeps that step out of the gate's costs)."""
        if len(seq.token_ids) - self.seen.get(seq.id, 0) > self.LAG:
            self._catching.add(seq.id)
        self.seen[seq.id] = len(seq.token_ids)

    def float_drafts(self, seq: Sequence, budget: int) -> int:
        """Draft rows for a floating chunk (a sequence with a step in flight: async_.py),
        decided as `drafts` decides them but without the lookup, which the runner makes
        once the step before has run: at most k, what the length limit leaves after that
        step's drafts all hold (the fewest tokens left), the budget, the gate's share."""
        if seq.req.sampling.options.thinking_token_budget is not None:
            return 0
        if self._eligible is not None and seq.id not in self._eligible:
            return 0       # a probe's, for a sequence the draft model is far behind
        left = stop.tokens_left(seq, len(seq.token_ids) + seq.num_pending + seq.in_flight_drafts)
        k = min(self.k, left - 1, budget - 1)
        if self.gate is not None and k > 0:
            k = min(draft_len(self.acceptance(seq.id), self._threshold, k), self._cap or 0)
        if k <= 0:
            return 0
        if self._cap is not None:
            self._cap -= k
        if self.catches_up:
            self._followed(seq)
        return k

    def unplanned(self, k: int) -> None:
        """Draft rows `float_drafts` gave that the chunk did not take (no room for them)."""
        if self._cap is not None:
            self._cap += k

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
        self.seen.pop(seq_id, None)
        self._catching.discard(seq_id)


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
