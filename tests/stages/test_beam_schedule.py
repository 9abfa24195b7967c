"""Beam search in the scheduler (stages/schedule/beam.py): forking by shared blocks,
re-ranking per round, and the block accounting, against a reference search.

The runner here is a stand-in with a real paged store: each chunk writes its token ids
into the (block, offset) slots of its block table, and a row's logprobs are a fixed
function of the history it reads back through that table. So a beam that reads a block
another beam overwrote, or a fork that lost its parent's prefix, gets other logprobs and
the beams differ from the reference search, which runs the same function on plain lists.
"""
from __future__ import annotations

import math

import pytest

from gpu.interface import StepPlan, StepResult, TokenLogprobs
from tests.support.rendered import rendered
from stages.delta import FinishReason
from stages.messages import SamplingParams
from stages.schedule import Scheduler
from stages.schedule.async_ import AsyncScheduler
from stages.schedule.beam import score
from stages.schedule.blocks import BlockManager
import attrs

V = 7          # vocabulary; token 0 is EOS
EOS = 0


def logprobs_of(history: list[int]) -> list[float]:
    """A fixed next-token distribution for a history (distinct values, no ties)."""
    h = 1469598103
    for t in history:
        h = (h * 1099511628211 + t + 7) % (1 << 61)
    logits = [((h >> (5 * i)) % 997) / 97.0 + 0.001 * i for i in range(V)]
    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - z for x in logits]


class PagedRunner:
    """Executes plans on a paged token store (block, offset) -> token id."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.store: dict[tuple[int, int], int] = {}
        self.opts: dict[str, object] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.released:
            self.opts.pop(sid)
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.opts
            self.opts[ns.seq_id] = ns.sampling
        ids, toks, lps = [], [], []
        for c in plan.chunks:
            assert c.seq_id in self.opts, "a chunk before its SeqStart"
            for j, tok in enumerate(c.token_ids):
                pos = c.start_pos + j
                self.store[(c.block_table[pos // self.bs], pos % self.bs)] = tok
            if not c.sample:
                continue
            end = c.start_pos + len(c.token_ids)
            hist = [self.store[(c.block_table[p // self.bs], p % self.bs)] for p in range(end)]
            lp = logprobs_of(hist)
            order = sorted(range(V), key=lambda i: -lp[i])
            k = self.opts[c.seq_id].logprobs
            ids.append(c.seq_id)
            toks.append(order[0])
            lps.append(TokenLogprobs(lp[order[0]], tuple(order[:k]), tuple(lp[i] for i in order[:k])))
        return StepResult(plan.step, tuple(ids), tuple(toks), 0.0, logprobs=tuple(lps))


def reference(prompt, width, max_tokens, length_penalty=1.0, ignore_eos=False, include_eos=False):
    """vLLM's beam search loop (its OpenAI serving's beam_search), on plain lists."""
    key = lambda b: score(len(b[0]), b[0][-1], b[1], frozenset({EOS}), length_penalty)
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        new = []
        for toks, cum in beams:
            lp = logprobs_of(toks)
            for t in sorted(range(V), key=lambda i: -lp[i])[:2 * width]:
                if t == EOS and not ignore_eos:
                    done.append((toks + [t] if include_eos else toks, cum + lp[t], "stop"))
                else:
                    new.append((toks + [t], cum + lp[t]))
        beams = sorted(new, key=key, reverse=True)[:width]
    done += [(t, c, "length") for t, c in beams]
    best = sorted(done, key=key, reverse=True)[:width]
    return [(tuple(t[len(prompt):]), c, f) for t, c, f in best]


def beam_request(rid, prompt, width, max_tokens, length_penalty=1.0, logprobs=None, **own):
    r = rendered(rid, prompt, max_tokens=max_tokens, body={"n": width}, logprobs=logprobs, **own)
    return attrs.evolve(r, sampling=attrs.evolve(r.sampling, beam_width=width,
                                                 length_penalty=length_penalty))


def make(cls=Scheduler, num_blocks=64, bs=4, budget=64, max_seqs=16, prefix=True, policy="fcfs"):
    return cls(BlockManager(num_blocks, bs, enable_prefix_caching=prefix), max_num_seqs=max_seqs,
               max_num_batched_tokens=budget, max_model_len=256, eos_token_ids=(EOS,),
               policy=policy)


def run(s, runner, limit=500, watch=None):
    """Plans and results, AsyncScheduler's two in flight included; all the deltas."""
    deltas, flight = [], []
    for _ in range(limit):
        if not s.has_work() and not flight:
            break
        while len(flight) < s.max_in_flight and s.has_work():
            plan = s.schedule()
            flight.append((plan, runner.execute(plan)))
            if watch:
                watch(s)
        plan, result = flight.pop(0)
        deltas += s.update(plan, result).deltas
    assert not s.has_work() and not flight
    return deltas


def choices(deltas, rid="r"):
    """Per choice index: (tokens, summed logprobs, finish reason), and each seen once."""
    out = {}
    for d in deltas:
        if d.request_id == rid and d.finish_reason is not None:
            assert d.index not in out
            out[d.index] = (d.token_ids, sum(t.logprob for t in d.token_ids and d.token_logprobs),
                            d.finish_reason.value)
    return [out[i] for i in sorted(out)]


def check_no_leak(s):
    bm = s.blocks
    assert bm.num_used == 0 and not any(bm.ref_count)
    assert not s.by_id and not s.choices and not s.beam_search.groups and not s.running and not s.waiting


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("prompt, width, max_tokens, lp", [
    ((3, 1, 4, 1, 5, 2), 3, 6, 1.0),          # a partly filled prompt block: forks recompute it
    ((3, 1, 4, 1, 5, 2, 6, 5), 2, 9, 0.5),    # the prompt fills its blocks exactly
    ((2,), 4, 5, 2.0),
])
def test_beams_equal_the_reference_search_and_free_every_block(cls, prompt, width, max_tokens, lp):
    s, runner = make(cls), PagedRunner(4)
    s.add(beam_request("r", prompt, width, max_tokens, lp, logprobs=0))
    shared = []
    deltas = run(s, runner, watch=lambda s: shared.append(max(s.blocks.ref_count)))
    got = choices(deltas)
    want = reference(prompt, width, max_tokens, lp)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[2] for g in got] == [w[2] for w in want]
    for g, w in zip(got, want):   # (a beam ended by EOS shows no logprob for the EOS)
        if w[2] == "length":
            assert g[1] == pytest.approx(w[1], abs=1e-9)
    assert max(shared) > 1            # the beams held blocks together
    check_no_leak(s)
    assert not runner.opts            # every beam's runner state was released


def test_eos_finishes_hypotheses_with_and_without_the_eos_token():
    prompt = (5, 5, 1)
    for include in (False, True):
        want = reference(prompt, 3, 8, include_eos=include)
        assert any(f == "stop" for _, _, f in want)     # this prompt's search meets EOS
        s = make()
        s.add(beam_request("r", prompt, 3, 8, include_stop_str_in_output=include))
        deltas = run(s, PagedRunner(4))
        got = [(d.token_ids, d.finish_reason.value, d.stop_reason) for d in deltas
               if d.finish_reason is not None]
        assert [(g[0], g[1]) for g in got] == [(w[0], w[2]) for w in want]
        assert all(g[2] == (EOS if g[1] == "stop" else None) for g in got)
        check_no_leak(s)
    want = reference(prompt, 3, 8, ignore_eos=True)
    s = make()
    s.add(beam_request("r", prompt, 3, 8, ignore_eos=True))
    got = [d.token_ids for d in run(s, PagedRunner(4)) if d.finish_reason is not None]
    assert got == [w[0] for w in want] and all(len(t) == 8 for t in got)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_preemption_under_a_tiny_cache_keeps_the_beams(cls, policy):
    prompt = (3, 1, 4, 1, 5, 2, 6)
    want = reference(prompt, 3, 10)
    s = make(cls, num_blocks=9, bs=2, budget=8, prefix=False, policy=policy)
    runner = PagedRunner(2)
    s.add(beam_request("r", prompt, 3, 10, logprobs=0))
    got = choices(run(s, runner))
    assert s.num_preemptions > 0
    assert [g[0] for g in got] == [w[0] for w in want]
    check_no_leak(s)


def test_abort_mid_search_frees_every_block_and_ends_each_choice_once():
    s, runner = make(), PagedRunner(4)
    s.add(beam_request("r", (3, 1, 4, 1, 5), 3, 20))
    s.add(rendered("other", (1, 2, 3), max_tokens=30))
    for _ in range(6):
        s.update(plan := s.schedule(), runner.execute(plan))
    assert len(s.choices["r"]) == 3 and s.blocks.num_used > 0
    s.finish("r", FinishReason.ABORT)
    deltas = run(s, runner)
    ends = [d.index for d in deltas if d.request_id == "r"]
    assert sorted(ends) == [0, 1, 2]
    assert all(d.finish_reason == FinishReason.ABORT for d in deltas if d.request_id == "r")
    check_no_leak(s)


def test_a_batch_of_prompts_runs_a_search_per_prompt():
    prompts = ((3, 1, 4), (2, 7 % V, 1, 8 % V, 2))
    r = beam_request("r", prompts[0], 2, 5)
    r = attrs.evolve(r, prompts=prompts, prompt_max_tokens=(5, 3))
    s = make()
    s.add(r)
    got = choices(run(s, PagedRunner(4)))
    want = reference(prompts[0], 2, 5) + reference(prompts[1], 2, 3)
    assert [g[0] for g in got] == [w[0] for w in want]
    check_no_leak(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_a_search_wider_than_max_num_seqs_takes_turns(cls, policy):
    prompt = (3, 1, 4, 1, 5)
    want = reference(prompt, 3, 6)
    s = make(cls, max_seqs=2, policy=policy)
    s.add(beam_request("r", prompt, 3, 6))
    got = [d.token_ids for d in run(s, PagedRunner(4)) if d.finish_reason is not None]
    assert got == [w[0] for w in want]
    check_no_leak(s)
