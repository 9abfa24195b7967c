"""The scheduler with LoRA adapters (issue 33): at most --max-loras distinct adapters run
(so in any one step), each sequence's SeqStart carries its adapter, and the prefix cache
keys blocks by adapter."""
from __future__ import annotations

import attrs

from tests.support.rendered import rendered

from gpu.interface import LoRARef, StepResult
from stages.schedule import Scheduler
from stages.schedule.blocks import BlockManager

A, B, C = (LoRARef(n, i, f"/{n}") for i, n in enumerate("abc", 1))


def make(max_loras: int) -> Scheduler:
    return Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=256,
                     max_model_len=256, eos_token_ids=(0,), max_loras=max_loras)


def req(rid, prompt, lora, max_tokens=3):
    return attrs.evolve(rendered(rid, prompt, max_tokens=max_tokens), lora=lora)


def step(s: Scheduler):
    plan = s.schedule()
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    s.update(plan, StepResult(plan.step, sampled, (9,) * len(sampled), 0.0))
    return plan


def test_no_step_mixes_more_than_max_loras_adapters():
    s = make(max_loras=2)
    for rid, lora in (("a1", A), ("b1", B), ("base", None), ("c1", C), ("a2", A)):
        s.add(req(rid, [1, 2, 3], lora))
    first = step(s)
    # a1, b1 and the base request start; c1 waits (a third adapter), and a2 behind it
    assert [c.seq_id for c in first.chunks] == ["a1", "b1", "base"]
    assert {ns.seq_id: ns.lora for ns in first.new_seqs} == {"a1": A, "b1": B, "base": None}
    seen = set()
    while s.has_work():
        plan = step(s)
        ids = {s_.req.lora.id for s_ in s.running if s_.req.lora is not None}
        assert len(ids) <= 2
        by_id = {ns.seq_id: ns for ns in plan.new_seqs}
        seen.update(by_id)
        if "c1" in by_id:
            assert by_id["c1"].lora == C
    assert {"c1", "a2"} <= seen


def test_prefix_cache_is_keyed_by_adapter():
    s = make(max_loras=3)
    prompt = list(range(1, 14))          # 3 full blocks of 4
    s.add(req("a", prompt, A))
    while s.has_work():
        step(s)
    for rid, lora, hit in (("a-again", A, 12), ("b", B, 0), ("base", None, 0)):
        s.add(req(rid, prompt, lora))
        plan = step(s)
        assert plan.chunks[0].start_pos == hit, rid
        while s.has_work():
            step(s)
