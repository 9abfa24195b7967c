"""The scheduler's pure core: budgets, prefix caching, chunked prefill, preemption."""
from __future__ import annotations

import attrs

from gpu.interface import StepResult
from stages.schedule.blocks import BlockManager
from tests.support.rendered import rendered
from stages.messages import RenderedRequest
from stages.delta import FinishReason
from stages.schedule import Scheduler


def req(rid: str, prompt, max_tokens: int = 4) -> RenderedRequest:
    return rendered(rid, prompt, max_tokens=max_tokens)


def make(num_blocks=32, block_size=4, budget=64, max_seqs=8, prefix=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=prefix),
                     max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                     eos_token_ids=(0,))


def step(s: Scheduler, token: int = 9):
    plan = s.schedule()
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    out = s.update(plan, StepResult(plan.step, sampled, (token,) * len(sampled), 0.0))
    return plan, out


def run_all(s: Scheduler, limit: int = 200):
    plans, outs = [], []
    for _ in range(limit):
        if not s.has_work():
            break
        p, o = step(s)
        plans.append(p)
        outs.append(o)
    return plans, outs


def test_prefix_cache_hit_reports_cached_tokens_and_shares_blocks():
    s = make()
    prompt = list(range(1, 15))                      # 14 tokens: 3 full blocks of 4
    s.add(req("a", prompt))
    run_all(s)
    s.add(req("b", prompt))
    plan, out = step(s)
    [chunk] = plan.chunks
    assert chunk.start_pos == 12                     # 3 cached blocks, 2 tokens to compute
    assert chunk.token_ids == tuple(prompt[12:])
    run_all(s)
    # the cached count reaches downstream with every update
    assert out.deltas[0].num_cached_tokens == 12


def test_cache_salt_keeps_prefix_reuse_apart():
    s = make()
    prompt = list(range(1, 15))
    s.add(attrs.evolve(req("a", prompt), cache_salt="tenant-a"))
    run_all(s)
    s.add(attrs.evolve(req("b", prompt), cache_salt="tenant-b"))   # another tenant: no reuse
    plan, out = step(s)
    assert plan.chunks[0].start_pos == 0 and out.deltas[0].num_cached_tokens == 0
    run_all(s)
    s.add(req("c", prompt))                                         # no salt: no reuse either
    plan, _ = step(s)
    assert plan.chunks[0].start_pos == 0
    run_all(s)
    s.add(attrs.evolve(req("d", prompt), cache_salt="tenant-a"))   # the same tenant: reuse
    plan, out = step(s)
    assert plan.chunks[0].start_pos == 12 and out.deltas[0].num_cached_tokens == 12


def test_full_prompt_hit_still_computes_the_last_token():
    s = make()
    prompt = list(range(1, 13))                      # exactly 3 blocks
    s.add(req("a", prompt))
    run_all(s)
    s.add(req("b", prompt))
    plan, _ = step(s)
    assert plan.chunks[0].start_pos == 8 and len(plan.chunks[0].token_ids) == 4


def test_no_prefix_caching_when_disabled():
    s = make(prefix=False)
    s.add(req("a", range(1, 15)))
    run_all(s)
    s.add(req("b", range(1, 15)))
    plan, _ = step(s)
    assert plan.chunks[0].start_pos == 0


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=5)
    s.add(req("a", range(1, 13), max_tokens=2))      # 12 prompt tokens, budget 5 per step
    plans, outs = run_all(s)
    sizes = [len(p.chunks[0].token_ids) for p in plans if p.chunks]
    assert sizes[:3] == [5, 5, 2]
    assert [p.chunks[0].sample for p in plans[:3] if p.chunks] == [False, False, True]
    assert all(sum(len(c.token_ids) for c in p.chunks) <= 5 for p in plans)


def test_decodes_and_prefill_chunks_share_a_step():
    s = make(budget=6)
    s.add(req("a", range(1, 4), max_tokens=5))
    step(s)                                          # a's prefill
    s.add(req("b", range(20, 40), max_tokens=2))
    plan, _ = step(s)
    sizes = {c.seq_id: len(c.token_ids) for c in plan.chunks}
    assert sizes == {"a": 1, "b": 5}


def test_preemption_by_recompute_keeps_outputs():
    # 6 blocks of 4 tokens; three requests that each grow to 12 tokens cannot all fit.
    s = make(num_blocks=6, block_size=4, budget=64, prefix=False)
    for rid in "abc":
        s.add(req(rid, range(1, 5), max_tokens=8))
    plans, outs = run_all(s)
    assert s.num_preemptions > 0
    produced: dict[str, int] = {}
    for o in outs:
        for d in o.deltas:
            produced[d.request_id] = produced.get(d.request_id, 0) + len(d.token_ids)
    assert produced == {"a": 8, "b": 8, "c": 8}
    assert s.blocks.num_used == 0
    # a recomputed sequence re-prefills its prompt plus the outputs it had
    assert any(c.start_pos == 0 and len(c.token_ids) > 4 for p in plans for c in p.chunks)


def test_max_num_seqs_limits_the_batch():
    s = make(max_seqs=2)
    for rid in "abcd":
        s.add(req(rid, range(1, 3)))
    plan, _ = step(s)
    assert len(plan.chunks) == 2 and len(s.waiting) == 2


def test_eos_stops_and_frees():
    s = make()
    s.add(req("a", range(1, 4), max_tokens=10))
    plan, out = step(s, token=0)                     # 0 is EOS
    assert out.deltas[0].finish_reason == FinishReason.STOP
    assert s.blocks.num_used == 0
    assert s.schedule().released == ("a",)


def test_lru_eviction_reuses_uncached_blocks_first():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    bm.commit_full_blocks(a, [1, 2, 3, 4], 4, 0, None)
    b = bm.allocate(1)
    bm.release(b)                                    # uncached: goes to the front
    bm.release(a)                                    # cached: stays matchable
    got = bm.allocate(1)
    assert got == b
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == a


def test_n_choices_share_the_prompt_through_the_prefix_cache():
    s = make(block_size=4)
    prompt = list(range(1, 15))                      # 14 tokens: 3 full blocks
    s.add(rendered("a", prompt, max_tokens=10, body={"n": 3}, seed=7))
    assert [seq.id for seq in s.waiting] == ["a#0", "a#1", "a#2"]
    plan, out = step(s)
    assert [c.seq_id for c in plan.chunks] == ["a#0"]          # the others wait one step
    assert [n.seq_id for n in plan.new_seqs] == ["a#0"]
    plan, out = step(s)
    starts = {c.seq_id: c.start_pos for c in plan.chunks}
    assert starts["a#1"] == starts["a#2"] == 12                # 3 blocks from the cache
    assert [n.sampling.seed for n in plan.new_seqs] == [8, 9]  # seed + index
    assert {(d.request_id, d.index) for d in out.deltas} == {("a", 0), ("a", 1), ("a", 2)}
    s.finish("a", FinishReason.STOP, index=1)                  # a stop string in choice 1
    plan, out = step(s)
    assert [(d.index, d.finish_reason) for d in out.deltas if d.finished] == [
        (1, FinishReason.STOP)]
    assert "a#1" in plan.released and {c.seq_id for c in plan.chunks} == {"a#0", "a#2"}
    s.finish("a", FinishReason.ABORT)                          # the client leaves: all of it
    _, out = step(s)
    assert sorted(d.index for d in out.deltas if d.finish_reason is FinishReason.ABORT) == [0, 2]
    assert not s.choices and not s.by_id and s.blocks.num_used == 0


def test_several_prompts_are_choices_i_times_n_plus_j():
    s = make(block_size=4)
    r = attrs.evolve(rendered("a", (1, 2, 3, 4, 5), max_tokens=2, body={"n": 2}, seed=7),
                     prompts=((1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11)), prompt_max_tokens=(2, 3))
    s.add(r)
    assert [(seq.id, tuple(seq.token_ids), seq.max_tokens) for seq in s.waiting] == [
        ("a#0", (1, 2, 3, 4, 5), 2), ("a#1", (1, 2, 3, 4, 5), 2),
        ("a#2", (6, 7, 8, 9, 10, 11), 3), ("a#3", (6, 7, 8, 9, 10, 11), 3)]
    plan, first = step(s)
    assert [c.seq_id for c in plan.chunks] == ["a#0"]     # a#1 waits for its prompt's first
    plan, second = step(s)
    assert {n.seq_id: n.sampling.seed for n in plan.new_seqs} == {"a#1": 8, "a#2": 7}
    assert {n.seq_id: n.prompt_token_ids for n in plan.new_seqs}["a#2"] == (6, 7, 8, 9, 10, 11)
    _, outs = run_all(s)
    deltas = [d for o in [first, second, *outs] for d in o.deltas]
    counts = {i: sum(len(d.token_ids) for d in deltas if d.index == i) for i in range(4)}
    assert counts == {0: 2, 1: 2, 2: 3, 3: 3}               # each prompt's own max_tokens
    done = [d for d in deltas if d.finished]
    assert sorted((d.index, d.finish_reason) for d in done) == [
        (i, FinishReason.LENGTH) for i in range(4)]
    assert not s.choices and s.blocks.num_used == 0


def test_prompt_logprobs_take_nothing_from_the_cache_and_come_on_the_first_delta():
    from gpu.interface import PromptLogprobs, TokenLogprobs

    s = make(block_size=4)
    prompt = list(range(1, 11))
    s.add(rendered("warm", prompt, max_tokens=1))
    run_all(s)
    r = rendered("a", prompt, max_tokens=2, body={"n": 2})
    s.add(attrs.evolve(r, sampling=attrs.evolve(r.sampling, prompt_logprobs=1)))
    plan = s.schedule()
    [chunk] = plan.chunks
    assert chunk.start_pos == 0 and len(chunk.token_ids) == 10     # the whole prompt
    assert plan.new_seqs[0].prompt_logprobs == 1
    entries = tuple(TokenLogprobs(-1.0 * p, rank=p) for p in range(1, 10))
    out = s.update(plan, StepResult(plan.step, ("a#0",), (9,), 0.0,
                                    prompt_logprobs=(PromptLogprobs("a#0", entries),)))
    [d] = out.deltas
    assert d.prompt_token_logprobs == (None, *entries) and d.num_cached_tokens == 0
    plan, out = step(s)
    follower = {n.seq_id: n for n in plan.new_seqs}["a#1"]
    assert follower.prompt_logprobs is None                        # the prompt's first only
    assert {c.seq_id: c.start_pos for c in plan.chunks}["a#1"] == 8   # from the cache
    assert all(not d.prompt_token_logprobs for d in out.deltas)


def test_max_tokens_0_finishes_after_the_prompt_with_no_token():
    s = make()
    s.add(rendered("a", (1, 2, 3), max_tokens=0))
    _, outs = run_all(s)
    [d] = [d for o in outs for d in o.deltas]
    assert d.token_ids == () and d.finish_reason is FinishReason.LENGTH
    assert s.blocks.num_used == 0
