"""The hybrid KV block manager (stages/schedule/blocks.py SlidingHalves): sliding-window layers keep
their K/V in a pool of their own, and a block's sliding half goes back to that pool once every
holder's window has passed it.

A long request runs in a sliding pool far smaller than its length; randomised runs (shared
prefixes, aborts, preemption, one step planned ahead) check after every plan and update that
the halves' bookkeeping matches the block tables, and model the runner: the plan's
(block, slot) updates applied before the step, each query reads the slots its window reaches
through them, and those hold exactly its tokens."""
import random
from collections import Counter

import pytest

from gpu.interface import PLACEHOLDER, StepResult
from tests.support.rendered import rendered
from stages.schedule.blocks import BlockManager
from stages.schedule import AsyncScheduler, Scheduler
from tests.support.scheduler_workload import RunnerModel, Workload


def check_hybrid(s):
    bm, sl = s.blocks, s.blocks.sliding
    users = Counter()
    for seq in list(s.running) + list(s.waiting):
        assert 0 <= seq.passed <= len(seq.table)
        assert seq.passed <= sl.passed(seq.num_done), (seq.id, seq.passed, seq.num_done)  # never too early
        for b in seq.table[seq.passed:]:
            users[b] += 1
            assert sl.slot_of[b] >= 0, ("a block in a window has no slot", seq.id, b)
    for b in range(bm.num_blocks):
        assert sl.users[b] == users[b], (b, sl.users[b], users[b])
    assert set(sl.evictable) == {b for b in range(bm.num_blocks) if sl.slot_of[b] >= 0 and users[b] == 0}
    attached = [sl.slot_of[b] for b in range(bm.num_blocks) if sl.slot_of[b] >= 0]
    assert len(attached) == len(set(attached)), "a slot lent twice"
    assert sorted(attached + sl.free_slots) == list(range(sl.num_slots))
    in_use = sl.num_slots - sl.available
    assert in_use == sum(1 for b in range(bm.num_blocks) if users[b]), in_use


def scheduler(nb, bs, slots, window, scheduler_class=Scheduler, **kw):
    return scheduler_class(BlockManager(nb, bs, sliding=(slots, window)), max_model_len=kw.pop("max_model_len", 256),
                     eos_token_ids=(0,), **kw)


def test_a_long_request_frees_sliding_halves_as_it_passes_the_window():
    """Window 6, blocks of 4: a query needs at most 3 blocks' halves (positions q-5..q), yet
    the request's 100 tokens span 25 blocks; 4 slots suffice, with no preemption."""
    s = scheduler(32, 4, 4, 6, max_num_seqs=1, max_num_batched_tokens=4)
    s.add(rendered("long", list(range(1, 21)), max_tokens=80))
    in_use_seen, table_len = [], 0
    while s.has_work():
        plan = s.schedule()
        sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
        s.update(plan, StepResult(plan.step, sampled, (7,) * len(sampled), 0.0))
        check_hybrid(s)
        sl = s.blocks.sliding
        in_use_seen.append(sl.num_slots - sl.available)
        if s.running:
            table_len = len(s.running[0].table)
            assert s.running[0].passed >= table_len - 3
    assert s.num_preemptions == 0 and table_len == 25
    assert max(in_use_seen) <= 3 and in_use_seen[-1] == 0      # released at the end
    assert s.blocks.num_free == 32


def test_prefix_hit_needs_the_halves_of_its_window():
    """A second identical prompt reuses the full blocks; its first computed position's window
    needs the last block's half, which was kept (evictable) after the first finished. Once
    that half is taken by other blocks, the hit shrinks to what the remaining halves cover."""
    s = scheduler(16, 4, 6, 6, max_num_seqs=1, max_num_batched_tokens=32)
    prompt = list(range(1, 14))                         # 13 tokens: 3 full blocks cacheable

    def run(rid, p, n):
        s.add(rendered(rid, p, max_tokens=n))
        while s.has_work():
            plan = s.schedule()
            sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
            s.update(plan, StepResult(plan.step, sampled, (7,) * len(sampled), 0.0))
            check_hybrid(s)
        return s

    run("a", prompt, 1)
    s.add(rendered("b", prompt, max_tokens=1))
    plan = s.schedule()
    assert plan.chunks[0].start_pos == 12                # 3 cached blocks: positions 0..11
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    s.update(plan, StepResult(plan.step, sampled, (7,), 0.0))
    check_hybrid(s)
    # other prompts take every slot: the halves of "a"'s blocks are taken over
    run("c", [50 + i for i in range(24)], 1)
    s.add(rendered("d", prompt, max_tokens=1))
    plan = s.schedule()
    sl = s.blocks.sliding
    assert plan.chunks[0].start_pos < 12
    check_hybrid(s)


def run_async(seed):
    rng = random.Random(seed)
    nb, bs = rng.randint(6, 20), rng.choice([1, 2, 4])
    window = rng.randint(1, 9)
    per_seq = -(-(window - 1) // bs) + 2
    budget = rng.randint(1, 12)
    max_seqs = rng.randint(1, 4)
    need = per_seq + -(-budget // bs)                        # one sequence alone
    slots = rng.randint(need, max(need, nb))
    s = scheduler(nb, bs, slots, window, AsyncScheduler, max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, max_model_len=64)
    w = Workload(rng, s, nb * bs, max_prompt=16, max_new=16)
    full_kv, sliding_kv = {}, {}
    slot_map = [0] * nb                                      # the runner's copy (KVCache.sliding_map)
    runner = RunnerModel(rng)

    def execute(plan):
        for b, slot in plan.kv_updates:
            slot_map[b] = max(slot, 0)
        runner.take(plan)

        def sslot(c, p):
            return slot_map[c.block_table[p // bs]] * bs + p % bs

        read = set()
        for c in plan.chunks:
            for q in range(c.start_pos, c.start_pos + len(c.token_ids)):
                read |= {sslot(c, p) for p in range(max(0, q - window + 1), c.start_pos)}
        written = set()
        for c in plan.chunks:
            full = runner.tokens(c.seq_id)
            ids = list(c.token_ids)
            if ids[-1] == PLACEHOLDER:
                ids[-1] = runner.outputs[c.seq_id][-1]
            assert ids == full[c.start_pos:c.start_pos + len(ids)]
            for q in range(c.start_pos, c.start_pos + len(ids)):
                for p in range(max(0, q - window + 1), c.start_pos):    # what the window reads
                    assert sliding_kv.get(sslot(c, p)) == tuple(full[:p + 1]), ("stale sliding kv", c.seq_id, p)
            for p in range(c.start_pos):
                assert full_kv.get(c.block_table[p // bs] * bs + p % bs) == tuple(full[:p + 1])
            for p in range(c.start_pos, c.start_pos + len(ids)):
                slot = sslot(c, p)
                assert slot not in written and slot not in read, "sliding write conflict"
                written.add(slot)
                sliding_kv[slot] = full_kv[c.block_table[p // bs] * bs + p % bs] = tuple(full[:p + 1])
        return runner.sample(plan)

    def apply(plan, result):
        for d in s.update(plan, result).deltas:
            w.record(d)
        check_hybrid(s)

    w.run_one_ahead(check_hybrid, execute, apply)
    assert not s.has_work(), ("hang", seed)
    assert s.blocks.num_free == nb and s.blocks.sliding.available == slots, "leak"
    assert len(w.finished) == w.n


@pytest.mark.parametrize("seed", range(200))
def test_hybrid_invariants_hold_with_async_scheduling(seed):
    run_async(seed)
