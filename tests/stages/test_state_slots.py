"""A hybrid model's state slots in the scheduler (stages/schedule/state_slots.py): each
running sequence holds one from its first chunk, every chunk names it, finishing and
preemption give it back. Randomised runs (plain and async scheduling, a tiny cache so
preemption happens, aborts and stop strings at any time) against a model of the runner's
state pool: a chunk that continues a sequence finds its slot holding exactly that
sequence's tokens before the chunk; at the end every slot is free."""
from __future__ import annotations

import random

import pytest

from gpu.interface import PLACEHOLDER, StepResult
from tests.support.rendered import rendered
from stages.delta import FinishReason
from stages.schedule import AsyncScheduler, Scheduler
from stages.schedule.blocks import BlockManager
from stages.schedule.state_slots import StateSlots
from tests.support.scheduler_workload import RunnerModel, Workload


def make(scheduler_class=Scheduler, num_blocks=16, block_size=4, budget=64, max_seqs=4, snapshots=0):
    return scheduler_class(BlockManager(num_blocks, block_size, enable_prefix_caching=bool(snapshots)),
                           max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64,
                           eos_token_ids=(0,), state_slots=StateSlots(max_seqs, snapshots, block_size))


def check(s):
    held = [q.slot for q in s.running if q.slot >= 0]
    slots = s.state_slots
    assert len(held) == len(set(held)), "two sequences share a slot"
    assert all(q.slot < 0 for q in s.waiting), "a waiting sequence holds a slot"
    assert slots.num_used == len(held)
    assert sorted(held + slots.free) == list(range(slots.num_slots))
    assert sorted(list(slots.snapshots.values()) + slots.free_snapshots) == \
        list(range(slots.num_slots, slots.num_slots + slots.num_snapshots))


class PoolModel:
    """The runner's StatePool as the tokens each slot has absorbed, by sequence."""

    def __init__(self, runner: RunnerModel) -> None:
        self.runner = runner
        self.slots: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.loads = 0

    def run(self, plan):
        self.runner.take(plan)
        for c in plan.chunks:      # before the forward: prefix-cache hits load their snapshot
            if c.state_load >= 0:
                assert c.start_pos > 0 and c.state_load in self.slots, ("no snapshot to load", c)
                self.slots[c.state_slot] = (c.seq_id, self.slots[c.state_load][1])
                self.loads += 1
        for c in plan.chunks:
            assert c.state_slot >= 0, c
            full = self.runner.tokens(c.seq_id)
            ids = list(c.token_ids)
            if ids[-1] == PLACEHOLDER:
                ids[-1] = self.runner.outputs[c.seq_id][-1]
            if c.start_pos:     # it continues: its slot holds it, up to the chunk
                assert self.slots.get(c.state_slot) == (c.seq_id, tuple(full[:c.start_pos])), \
                    ("stale state", c)
            self.slots[c.state_slot] = (c.seq_id, tuple(full[:c.start_pos]) + tuple(ids))
        saved = [c.state_save for c in plan.chunks if c.state_save >= 0]
        assert len(saved) == len(set(saved)), ("one snapshot slot written twice in a step", plan)
        for c in plan.chunks:      # after it: snapshots at block boundaries
            if c.state_save >= 0:
                assert (c.start_pos + len(c.token_ids)) % self.runner_block == 0, c
                self.slots[c.state_save] = ("snapshot", self.slots[c.state_slot][1])
        return self.runner.sample(plan)

    runner_block = 1


def run_random(seed, scheduler_class, snapshots) -> PoolModel:
    rng = random.Random(seed)
    nb, bs = rng.randint(4, 16), rng.choice([1, 2, 4])
    s = make(scheduler_class, nb, bs, budget=rng.randint(1, 12), max_seqs=rng.randint(1, 4),
             snapshots=snapshots)
    w = Workload(rng, s, nb * bs, max_prompt=10, max_new=8)
    pool = PoolModel(RunnerModel(rng))
    pool.runner_block = bs

    def apply(plan, result):
        for d in s.update(plan, result).deltas:
            w.record(d)
        check(s)

    if scheduler_class is AsyncScheduler:
        w.run_one_ahead(check, pool.run, apply)
    else:
        for it in range(2400):
            if it < 400:
                w.arrive()
            elif not s.has_work():
                break
            if s.has_work():
                plan = s.schedule()
                check(s)
                apply(plan, pool.run(plan))
    assert not s.has_work() and len(w.finished) == w.n
    assert s.state_slots.num_used == 0 and s.blocks.num_free == nb and not s.state_slots.seeds
    return pool


@pytest.mark.parametrize("snapshots", [0, 1, 2], ids=["no prefix cache", "1 snapshot", "2 snapshots"])
@pytest.mark.parametrize("scheduler_class", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("seed", range(30))
def test_every_chunk_continues_its_own_state_and_nothing_leaks(seed, scheduler_class, snapshots):
    """With snapshots (prefix caching), a hit's chunk finds its slot holding the snapshot of
    exactly its own prefix."""
    run_random(seed, scheduler_class, snapshots)


def test_the_random_runs_hit_snapshots():
    loads = [run_random(seed, cls, 2).loads for seed in range(10) for cls in (Scheduler, AsyncScheduler)]
    assert sum(loads) > 20, loads


def step(s, token=9):
    plan = s.schedule()
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    s.update(plan, StepResult(plan.step, sampled, (token,) * len(sampled), 0.0))
    return plan


def test_chunked_prefill_keeps_one_slot_and_preemption_gives_it_back():
    s = make(num_blocks=4, block_size=4, budget=6, max_seqs=2)
    s.add(rendered("a", list(range(1, 11)), max_tokens=1))      # 10 tokens: two chunks
    first, second = step(s), step(s)
    assert first.chunks[0].state_slot == second.chunks[0].state_slot == 0
    assert second.chunks[0].start_pos == 6 and s.state_slots.num_used == 0   # finished
    s.add(rendered("b", [1, 2, 3, 4, 5, 6], max_tokens=8))
    s.add(rendered("c", [1, 2, 3, 4, 5], max_tokens=8))
    plans = [step(s) for _ in range(4)]
    check(s)
    # b and c fill the 4 blocks; b's 9th token needs a fifth: c (the newest) is preempted
    assert s.num_preemptions == 1 and [q.id for q in s.running] == ["b"]
    assert {(c.seq_id, c.state_slot) for p in plans for c in p.chunks} == {("b", 0), ("c", 1)}
    assert s.state_slots.free == [1] and s.by_id["c"].slot == -1
    s.finish("b", FinishReason.ABORT)
    [chunk] = step(s).chunks                # c restarts from position 0, in a free slot
    assert (chunk.seq_id, chunk.start_pos) == ("c", 0) and chunk.state_slot in (0, 1)
    s.finish("c", FinishReason.ABORT)
    s.drain()
    assert s.state_slots.num_used == 0 and sorted(s.state_slots.free) == [0, 1]


def test_beam_search_is_refused_for_a_hybrid_model():
    import attrs

    s = make()
    req = rendered("beam", [1, 2, 3], max_tokens=4)
    req = attrs.evolve(req, sampling=attrs.evolve(req.sampling, beam_width=2))
    s.add(req)
    out = s.drain()
    assert out.deltas and out.deltas[0].finish_reason == FinishReason.ERROR
    assert "use_beam_search" in out.deltas[0].error
