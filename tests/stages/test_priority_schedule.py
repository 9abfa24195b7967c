"""Priority scheduling (--scheduling-policy priority, issue 37): lower priority first, ties
by arrival; a waiting request short of blocks preempts a running one of lower priority;
a running sequence short of blocks preempts the lowest-priority one, not the newest."""
import random

import attrs
import pytest

from gpu.interface import StepResult
from tests.support.rendered import rendered
from stages.schedule import AsyncScheduler, Scheduler
from stages.schedule.blocks import BlockManager
from tests.support.scheduler_checks import check, kvcheck
from tests.support.scheduler_workload import Workload, sampled_token


def req(rid, prompt, priority=0, max_tokens=4):
    return attrs.evolve(rendered(rid, prompt, max_tokens=max_tokens), priority=priority)


def make(policy="priority", num_blocks=32, block_size=4, budget=64, max_seqs=8, cls=Scheduler):
    return cls(BlockManager(num_blocks, block_size, enable_prefix_caching=False),
               max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
               eos_token_ids=(0,), policy=policy)


def step(s, token=9):
    plan = s.schedule()
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    return plan, s.update(plan, StepResult(plan.step, sampled, (token,) * len(sampled), 0.0))


def first_scheduled(s, limit=200):
    """Request ids in the order their first chunk was planned, and the order they finished."""
    started, finished = [], []
    for _ in range(limit):
        if not s.has_work():
            break
        plan, out = step(s)
        started += [ns.seq_id for ns in plan.new_seqs]
        finished += [d.request_id for d in out.deltas if d.finished]
    return started, finished


@pytest.mark.parametrize("policy, expected", [("priority", ["b", "d", "a", "c"]),
                                              ("fcfs", ["a", "b", "c", "d"])])
def test_lower_priority_runs_first_ties_by_arrival(policy, expected):
    s = make(policy, max_seqs=1)
    for rid, prio in (("a", 5), ("b", 0), ("c", 5), ("d", 0)):
        s.add(req(rid, [1, 2, 3], prio if policy == "priority" else 0))
    started, finished = first_scheduled(s)
    assert started == expected and finished == expected


def test_negative_priority_comes_before_zero():
    s = make(max_seqs=1)
    s.add(req("zero", [1, 2], 0))
    s.add(req("minus", [1, 2], -3))
    assert first_scheduled(s)[0] == ["minus", "zero"]


def test_waiting_high_priority_preempts_running_low_priority():
    # 4 blocks of 4 tokens: the low-priority request holds 3 (12 tokens), the urgent one
    # needs 2 for its 8-token prompt
    s = make(num_blocks=4)
    s.add(req("low", range(1, 11), priority=10, max_tokens=6))
    for _ in range(3):
        step(s)                                  # prefill + 2 decodes: 12 tokens, 3 blocks
    assert s.blocks.num_used == 3
    s.add(req("urgent", range(30, 38), priority=0, max_tokens=2))
    plan, _ = step(s)
    assert [c.seq_id for c in plan.chunks] == ["urgent"]     # low's decode was taken back
    assert s.num_preemptions == 1 and s.preempted == ["low"]
    assert [q.id for q in s.waiting] == ["low"]
    started, finished = first_scheduled(s)
    assert finished == ["urgent", "low"]
    assert s.blocks.num_used == 0


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make("fcfs", num_blocks=4)
    s.add(req("low", range(1, 11), max_tokens=20))
    for _ in range(3):
        step(s)
    s.add(req("urgent", range(30, 38), max_tokens=2))
    plan, _ = step(s)
    assert [c.seq_id for c in plan.chunks] == ["low"] and s.num_preemptions == 0


def test_equal_priority_later_arrival_is_not_preempted_for_a_new_request():
    s = make(num_blocks=4)
    s.add(req("first", range(1, 11), priority=1, max_tokens=20))
    for _ in range(3):
        step(s)
    s.add(req("second", range(30, 38), priority=1, max_tokens=2))
    plan, _ = step(s)
    assert [c.seq_id for c in plan.chunks] == ["first"] and s.num_preemptions == 0


def test_growth_preempts_the_lowest_priority_not_the_newest():
    # a (priority 9) then b (priority 0): both decode until the cache is full; b is the
    # newest, but a is the one preempted
    s = make(num_blocks=4, block_size=4)
    s.add(req("a", [1, 2, 3, 4], priority=9, max_tokens=10))
    s.add(req("b", [5, 6, 7, 8], priority=0, max_tokens=10))
    preempted = []
    for _ in range(40):
        if not s.has_work():
            break
        step(s)
        preempted += s.preempted
    assert preempted and set(preempted) == {"a"}


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("seed", range(40))
def test_priority_invariants_hold(seed, cls):
    """The randomised invariants (test_scheduler_invariants) under priority scheduling with
    random priorities: blocks and KV slots stay consistent, nothing leaks or hangs, and every
    request finishes once."""
    rng = random.Random(1000 + seed)
    nb, bs = rng.randint(4, 16), rng.choice([1, 2, 4])
    s = cls(BlockManager(nb, bs), max_num_seqs=rng.randint(1, 4),
            max_num_batched_tokens=rng.randint(1, 12), max_model_len=64, eos_token_ids=(0,),
            policy="priority")
    add = s.add
    s.add = lambda r: add(attrs.evolve(r, priority=rng.randint(-2, 2)))
    w = Workload(rng, s, nb * bs, max_prompt=10, max_new=8)
    kv, ahead = {}, []
    for it in range(2400):
        if it < 400:
            w.arrive()
        elif not s.has_work() and not ahead:
            break
        if len(ahead) < s.max_in_flight and s.has_work():
            plan = s.schedule()
            check(s)
            if cls is Scheduler:
                kvcheck(s, plan, kv)
            sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
            ahead.append((plan, StepResult(plan.step, sampled,
                                           tuple(sampled_token(rng) for _ in sampled), 0.0)))
            if len(ahead) < s.max_in_flight:
                continue
        if ahead:
            plan, result = ahead.pop(0)
            for d in s.update(plan, result).deltas:
                w.record(d)
            check(s)
    assert not s.has_work() and not ahead, ("hang", seed)
    assert s.blocks.num_free == nb, "leak"
    assert len(w.finished) == w.n


# -- render: the request field -------------------------------------------------------------
def test_render_refuses_priority_without_the_policy_and_carries_it_with():
    from tests.support.render_requests import chat, completion, error_of, make_ctx

    err = error_of(chat, {"priority": 3})
    assert err.status == 400 and err.param == "priority"
    assert "priority scheduling is not enabled" in err.message
    assert chat({"priority": 0}).priority == 0
    ctx = make_ctx(priority_scheduling=True)
    assert chat({"priority": -2}, ctx).priority == -2
    assert completion({"priority": 7}, ctx).priority == 7


def test_render_thinking_token_budget_needs_a_reasoning_parser():
    from tests.support.render_requests import chat, completion, error_of, make_ctx

    err = error_of(chat, {"thinking_token_budget": 5})
    assert err.status == 400 and err.param == "thinking_token_budget"
    assert chat({"thinking_token_budget": -1}).sampling.options.thinking_token_budget is None
    ctx = make_ctx(reasoning=True)
    assert chat({"thinking_token_budget": 5}, ctx).sampling.options.thinking_token_budget == 5
    assert completion({"thinking_token_budget": 0}, ctx).sampling.options.thinking_token_budget == 0
    assert error_of(chat, {"thinking_token_budget": -2}, ctx).status == 400
    no_tags = make_ctx(reasoning=True, think_tags=False)
    assert "single tokens" in error_of(chat, {"thinking_token_budget": 5}, no_tags).message
