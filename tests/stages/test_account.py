"""account's pure core (Accountant.process, Histogram): the usage numbers a reply shows and
the server-wide counters /metrics reads, driven step by step without trio.

The stage-level tests (tests/stages/test_stage_harness.py) cover one request's usage and
continuous usage; the timings and per-request metrics are in tests/stages/test_delta.py."""
from __future__ import annotations

import attrs
import pytest

from tests.support.rendered import rendered
from stages.account import TTFT_BUCKETS, Accountant, Histogram
from stages.delta import Delta, FinishReason, Usage
from stages.messages import Step


class Run:
    """One Accountant fed one Step per call: the deltas it passed on, by (request, choice)."""

    def __init__(self, *requests) -> None:
        self.acc = Accountant()
        self.pending = requests       # announced with the first step
        self.finished: list = []
        self.step = 0

    def __call__(self, *deltas: Delta, at: float = 0.0) -> dict:
        self.step += 1
        out, finished = self.acc.process(Step(self.step, self.pending, deltas, done_at=at))
        self.pending = ()
        self.finished += finished
        return {(d.request_id, d.index): d for d in out.deltas}


def test_n_choices_share_the_prompt_and_sum_their_completions():
    """n=2: the prompt counts once, completions add up over both choices; the choice that
    ends first carries the usage so far, the last one the request's final usage."""
    run = Run(rendered("a", (1, 2, 3), body={"n": 2}))
    run(Delta("a", (10,), index=0), Delta("a", (20,), index=1))
    out = run(Delta("a", (11,), FinishReason.LENGTH, index=0), Delta("a", (21,), index=1))
    # the totals so far in delta order: choice 1's token of this step comes after it
    assert out["a", 0].usage == Usage(prompt_tokens=3, completion_tokens=3)
    assert out["a", 1].usage is None and run.finished == []          # still open
    out = run(Delta("a", (22,), FinishReason.STOP, index=1))
    assert out["a", 1].usage == Usage(prompt_tokens=3, completion_tokens=5)
    assert run.finished == [("a", Usage(3, 5), FinishReason.STOP)]
    acc = run.acc
    assert (acc.prompt_tokens_total, acc.generation_tokens_total) == (3, 5)
    assert acc.finished_total == {FinishReason.STOP: 1}               # one request, once
    assert acc.requests == {}


def test_several_prompts_count_each_prompt_and_its_cache_hits_once():
    """A completions prompt list: prompt i's first choice (index i * n) reports that
    prompt's cache hits; the lookups count each prompt's length once, however many deltas
    repeat the figure."""
    req = attrs.evolve(rendered("a", (1, 2, 3, 4)), prompts=((1, 2, 3, 4), (5, 6)))
    run = Run(req)
    run(Delta("a", (7,), num_cached_tokens=4, scheduled_at=1.0, index=0),
        Delta("a", (8,), num_cached_tokens=0, scheduled_at=1.0, index=1))
    run(Delta("a", (9,), num_cached_tokens=4, index=0), Delta("a", (9,), index=1))
    out = run(Delta("a", (), FinishReason.STOP, num_cached_tokens=4, index=0),
              Delta("a", (), FinishReason.LENGTH, index=1))
    assert out["a", 1].usage == Usage(prompt_tokens=6, completion_tokens=4, cached_tokens=4)
    acc = run.acc
    assert (acc.prefix_cache_queries_total, acc.prefix_cache_hits_total) == (6, 4)
    assert (acc.prompt_tokens_total, acc.cached_tokens_total) == (6, 4)


def test_cached_tokens_follow_a_preemption_but_the_lookup_counts_once():
    """Preempted and scheduled again, a sequence reports its new cache hits: usage shows
    the latest figure, the prefix-cache counters the first lookup only."""
    run = Run(rendered("a", tuple(range(40))))
    run(Delta("a", (1,), num_cached_tokens=16, scheduled_at=1.0))
    out = run(Delta("a", (2,), FinishReason.LENGTH, num_cached_tokens=32, scheduled_at=1.0))
    assert out["a", 0].usage.cached_tokens == 32
    acc = run.acc
    assert (acc.prefix_cache_queries_total, acc.prefix_cache_hits_total) == (40, 16)
    assert acc.cached_tokens_total == 32


def test_abort_mid_stream_keeps_the_tokens_generated_and_no_latency():
    run = Run(attrs.evolve(rendered("a", (1, 2)), arrival=0.0, per_request_metrics=True))
    run(Delta("a", (5,), scheduled_at=0.5), at=1.0)
    run(Delta("a", (6,), scheduled_at=0.5), at=1.5)
    out = run(Delta("a", (), FinishReason.ABORT), at=9.0)
    assert out["a", 0].usage == Usage(prompt_tokens=2, completion_tokens=2)
    assert out["a", 0].metrics.generation_time_ms == 500.0   # up to its last token, not 9.0
    assert run.finished == [("a", Usage(2, 2), FinishReason.ABORT)]
    acc = run.acc
    assert acc.finished_total == {FinishReason.ABORT: 1}
    assert acc.ttft.count == 1 and acc.itl.count == 1
    assert all(h.count == 0 for h in (acc.e2e, acc.queue, acc.prefill, acc.decode))
    assert (acc.prompt_tokens_total, acc.generation_tokens_total) == (2, 2)


def test_abort_before_the_first_token_counts_nothing_but_the_prompt():
    run = Run(attrs.evolve(rendered("a", (1, 2, 3)), per_request_metrics=True))
    out = run(Delta("a", (), FinishReason.ABORT))
    assert out["a", 0].usage == Usage(prompt_tokens=3, completion_tokens=0)
    assert attrs.astuple(out["a", 0].metrics) == (0.0,) * 5
    acc = run.acc
    assert acc.prefix_cache_queries_total == 0           # never scheduled: never looked up
    assert acc.ttft.count == 0 and acc.prompt_tokens_total == 3


def test_an_engine_error_is_counted_but_not_timed():
    run = Run(rendered("a"))
    run(Delta("a", (5,)), at=1.0)
    run(Delta("a", (), FinishReason.ERROR, error="boom"), at=2.0)
    assert run.acc.finished_total == {FinishReason.ERROR: 1} and run.acc.e2e.count == 0


def test_reasoning_tokens_add_up_over_the_choices():
    run = Run(rendered("a", body={"n": 2}))
    out = run(Delta("a", (1, 2), FinishReason.STOP, reasoning_tokens=2, index=0),
              Delta("a", (3, 4, 5), FinishReason.STOP, reasoning_tokens=3, index=1))
    assert out["a", 0].usage.reasoning_tokens == 2
    assert out["a", 1].usage == Usage(3, 5, reasoning_tokens=5)


def test_inter_token_gaps_are_one_sequences_not_the_choices():
    """Choices of one request come back in the same steps: a gap is measured on choice 0
    only (two choices would otherwise double the count with zero-length gaps)."""
    run = Run(rendered("a", body={"n": 2}))
    for k, at in enumerate((1.0, 1.25, 1.75)):
        run(Delta("a", (k,), index=0), Delta("a", (k,), index=1), at=at)
    assert run.acc.itl.count == 2 and run.acc.itl.sum == 0.75
    assert run.acc.ttft.count == 1


def test_a_delta_of_a_request_account_does_not_know_is_dropped():
    """What arrives after a request's end (or for a request never announced) has no reply
    to go to: it is not passed on and counts nowhere."""
    run = Run(rendered("a"))
    run(Delta("a", (1,), FinishReason.STOP))
    out = run(Delta("a", (2,)), Delta("zz", (3,)))
    assert out == {} and run.acc.generation_tokens_total == 1


def test_continuous_usage_is_a_fresh_total_on_every_delta():
    run = Run(attrs.evolve(rendered("a", (1, 2), stream=True), continuous_usage=True))
    seen = [run(Delta("a", (t,), num_cached_tokens=0))["a", 0].usage for t in (7, 8)]
    assert seen == [Usage(2, 1), Usage(2, 2)]


def test_continuous_usage_shows_the_reasoning_tokens_so_far():
    """parse counts each delta's reasoning tokens: the running usage grows with them,
    not only when the choice ends."""
    run = Run(attrs.evolve(rendered("a", (1, 2), stream=True), continuous_usage=True))
    seen = [run(Delta("a", ids, reason, reasoning_tokens=r, num_cached_tokens=0))["a", 0].usage
            for ids, r, reason in (((7,), 1, None), ((8, 9), 2, None),
                                   ((10,), 0, FinishReason.STOP))]
    assert [u.reasoning_tokens for u in seen] == [1, 3, 3]
    assert seen[-1] == Usage(2, 4, reasoning_tokens=3)


def test_continuous_usage_of_several_choices_carries_each_choice_own_counts():
    """n > 1: each choice's chunks carry that choice's own completion tokens (vLLM's
    previous_num_tokens[i]), beside the request's running total (the final usage)."""
    run = Run(attrs.evolve(rendered("a", (1, 2), stream=True), continuous_usage=True, n=2))
    first = run(Delta("a", (7,), index=0), Delta("a", (8, 9), index=1))
    assert first["a", 0].usage.choice == Usage(2, 1) and first["a", 1].usage.choice == Usage(2, 2)
    assert first["a", 1].usage.completion_tokens == 3
    last = run(Delta("a", (5,), FinishReason.STOP, index=0),
               Delta("a", (6,), FinishReason.STOP, index=1))
    assert last["a", 0].usage.choice == Usage(2, 2) and last["a", 1].usage.choice == Usage(2, 3)
    assert last["a", 1].usage.completion_tokens == 5     # the request's, for the usage chunk
    # n == 1: the request's counts are the choice's, and there is no second copy
    run = Run(attrs.evolve(rendered("b", (1, 2), stream=True), continuous_usage=True))
    assert run(Delta("b", (7,)))["b", 0].usage == Usage(2, 1)


# -- Histogram: Prometheus' cumulative `le` buckets -------------------------------------------

def test_histogram_buckets_are_upper_bounds_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 1.0000001, 50.0):
        h.observe(v)
    assert h.counts == [1, 2, 2]                 # 0.1 is "le 0.1"; above the last: +Inf
    assert h.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 5)]
    assert h.count == 5 and h.sum == pytest.approx(52.6000001)


def test_histogram_empty_and_vllms_ttft_buckets():
    h = Histogram(TTFT_BUCKETS)
    assert h.count == 0 and h.sum == 0.0
    assert [n for _, n in h.cumulative()] == [0] * (len(TTFT_BUCKETS) + 1)
    assert list(TTFT_BUCKETS) == sorted(TTFT_BUCKETS)        # bisect needs them sorted
