"""Randomised invariants of the scheduler and block manager: requests arriving with shared
prefixes, aborts and stop-string finishes at any time, EOS, preemption under a tiny cache.
After every plan and update: reference counts match the block tables, free means unheld,
cached hashes match, budgets hold; each chunk reads KV slots that hold exactly its own
tokens and no slot is written twice in a step; at the end nothing leaks or hangs and every
request finished exactly once."""
import random
from collections import Counter

from gpu.interface import StepResult
from stages.schedule.blocks import BlockManager
from stages.delta import FinishReason
from stages.schedule import AsyncScheduler, Scheduler
from tests.support.scheduler_checks import check, kvcheck
from tests.support.scheduler_workload import RunnerModel, Workload, sampled_token


def random_scheduler(seed, scheduler_class=Scheduler):
    """A scheduler of random sizes (a tiny cache, so preemption happens) and its workload."""
    rng = random.Random(seed)
    nb, bs = rng.randint(4, 16), rng.choice([1, 2, 4])
    s = scheduler_class(BlockManager(nb, bs), max_num_seqs=rng.randint(1, 4),
                  max_num_batched_tokens=rng.randint(1, 12), max_model_len=64, eos_token_ids=(0,))
    return rng, nb, bs, s, Workload(rng, s, nb * bs, max_prompt=10, max_new=8)

def run(seed):
    rng, nb, bs, s, w = random_scheduler(seed)
    kv = {}
    for it in range(400):
        w.arrive()
        check(s)
        if not s.has_work():
            continue
        plan = s.schedule()
        check(s)
        kvcheck(s, plan, kv)
        sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
        toks = tuple(sampled_token(rng) for _ in sampled)
        out = s.update(plan, StepResult(plan.step, sampled, toks, 0.0))
        for d in out.deltas:
            w.record(d)
        check(s)
    # drain
    for it in range(2000):
        if not s.has_work(): break
        plan = s.schedule()
        kvcheck(s, plan, kv)
        sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
        out = s.update(plan, StepResult(plan.step, sampled, (7,)*len(sampled), 0.0))
        for d in out.deltas:
            w.record(d)
        check(s)
    assert not s.has_work(), ("hang", seed, [(q.id, len(q.token_ids)) for q in s.waiting], len(s.running))
    assert s.blocks.num_free == nb, "leak"
    assert len(w.finished) == w.n, (w.n, len(w.finished))


import pytest


@pytest.mark.parametrize("seed", range(300))
def test_scheduler_invariants_hold(seed):
    run(seed)


# -- async scheduling: step N+1 is planned before step N's result is applied -----------------
def run_async(seed):
    """As run(), with one step always planned ahead. A runner model executes the plans in
    order: it keeps each sequence's sampled tokens, fills in PLACEHOLDERs from them, and
    checks its chunk against prompt + samples and its KV slots. Each step's result reaches
    the scheduler only after the next step was planned."""
    from gpu.interface import PLACEHOLDER
    rng, nb, bs, s, w = random_scheduler(seed, AsyncScheduler)
    kv = {}
    runner = RunnerModel(rng)
    produced = Counter()

    def execute(plan):
        runner.take(plan)
        written = set()
        read = {c.block_table[p // bs] * bs + p % bs for c in plan.chunks for p in range(c.start_pos)}
        for c in plan.chunks:
            full = runner.tokens(c.seq_id)
            ids = list(c.token_ids)
            assert PLACEHOLDER not in ids[:-1]
            if ids[-1] == PLACEHOLDER:
                assert runner.outputs[c.seq_id], "a placeholder before any sampled token"
                ids[-1] = runner.outputs[c.seq_id][-1]
            assert ids == full[c.start_pos:c.start_pos + len(ids)], ("chunk", c, full)
            for p in range(c.start_pos):
                slot = c.block_table[p // bs] * bs + p % bs
                assert kv.get(slot) == tuple(full[:p + 1]), ("stale kv", c.seq_id, p)
            for p in range(c.start_pos, c.start_pos + len(ids)):
                slot = c.block_table[p // bs] * bs + p % bs
                assert slot not in written and slot not in read, "write conflict"
                written.add(slot)
                kv[slot] = tuple(full[:p + 1])
        return runner.sample(plan)

    def apply(plan, result):
        out = s.update(plan, result)
        for d in out.deltas:
            produced[d.request_id] += len(d.token_ids)
            w.record(d)
            if d.finished:
                # what the scheduler reports is what the runner sampled, in order
                assert produced[d.request_id] <= len(runner.outputs.get(d.request_id, ())) or \
                    d.finish_reason in (FinishReason.ABORT, FinishReason.STOP)
        check(s)

    w.run_one_ahead(check, execute, apply)
    assert not s.has_work(), ("hang", seed)
    assert s.blocks.num_free == nb, "leak"
    assert len(w.finished) == w.n, (w.n, len(w.finished))
    for rid, reason in w.finished.items():
        assert produced[rid] <= w.max_tokens[rid], rid     # never a token past max_tokens
        if reason == FinishReason.LENGTH:
            assert produced[rid] == w.max_tokens[rid], rid


@pytest.mark.parametrize("seed", range(300))
def test_scheduler_invariants_hold_with_async_scheduling(seed):
    run_async(seed)
