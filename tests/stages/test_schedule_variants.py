"""The scheduler's parts apart: the stop rule (stop.py), the plain Scheduler against
AsyncScheduler (async_.py), and the schedule stage waking on a compiled grammar instead of
polling."""
from __future__ import annotations

import sys
import threading
from concurrent.futures import Future

import attrs
import pytest
import trio

from gpu.interface import PLACEHOLDER, Constraint, ConstraintCompiler, StepResult
from pipeline.tools.harness import ScriptedRunner
from tests.support.rendered import rendered
from stages import gpu_step, schedule
from stages.delta import FinishReason
from stages.messages import Abort
from stages.schedule import AsyncScheduler, Scheduler, Sequence
from stages.schedule.blocks import BlockManager
from stages.schedule.stop import EOS, LENGTH, Stop, check_stop, tokens_left

EOS_ID = 0


def seq(prompt=(1, 2, 3), max_model_len=64, constraint=None, **kw) -> Sequence:
    req = rendered("r", prompt, **kw)
    if constraint is not None:
        req = attrs.evolve(req, sampling=attrs.evolve(req.sampling, constraint=constraint))
    return Sequence(req, (EOS_ID,), max_model_len)


# -- the stop rule ---------------------------------------------------------------------------
def test_a_token_that_stops_nothing_is_kept():
    assert check_stop(seq(max_tokens=4), (5,)) == (1, None)


def test_eos_stops_without_a_stop_reason():
    assert check_stop(seq(max_tokens=4), (EOS_ID,)) == (1, EOS)
    assert EOS == Stop(FinishReason.STOP, None)


def test_a_stop_token_id_is_the_stop_reason_even_when_it_is_eos():
    assert check_stop(seq(max_tokens=4, stop_token_ids=(7,)), (7,)) == (1, Stop(FinishReason.STOP, 7))
    assert check_stop(seq(max_tokens=4, stop_token_ids=(EOS_ID,)), (EOS_ID,)) == (
        1, Stop(FinishReason.STOP, EOS_ID))


def test_ignore_eos_goes_on_past_eos_unless_a_grammar_constrains():
    assert check_stop(seq(max_tokens=4, ignore_eos=True), (EOS_ID,)) == (1, None)
    constrained = seq(max_tokens=4, ignore_eos=True, constraint=Constraint("regex", "a+"))
    assert check_stop(constrained, (EOS_ID,)) == (1, EOS)


def test_max_tokens_and_max_model_len_end_by_length():
    s = seq(max_tokens=2)
    assert check_stop(s, (5,)) == (1, None)
    s.token_ids.append(5)
    assert check_stop(s, (6,)) == (1, LENGTH)
    short = seq(prompt=(1, 2, 3), max_model_len=4, max_tokens=100)
    assert short.end_len == 4 and check_stop(short, (5,)) == (1, LENGTH)


def test_a_stop_id_on_the_last_allowed_token_is_a_stop():
    assert check_stop(seq(max_tokens=1), (EOS_ID,)) == (1, EOS)


def test_a_verified_run_is_cut_after_the_token_that_stops_it():
    assert check_stop(seq(max_tokens=10, stop_token_ids=(7,)), (5, 7, 8, 9)) == (
        2, Stop(FinishReason.STOP, 7))
    assert check_stop(seq(max_tokens=3), (5, 6, 7, 8)) == (3, LENGTH)
    assert check_stop(seq(max_tokens=10), (5, 6, 8)) == (3, None)


def test_echo_alone_keeps_no_token():
    assert check_stop(seq(max_tokens=0), (5,)) == (0, LENGTH)


def test_tokens_left_counts_down_to_the_length_limit():
    s = seq(prompt=(1, 2, 3), max_tokens=4)
    assert tokens_left(s, 3) == 4 and tokens_left(s, 7) == 0


# -- Scheduler and AsyncScheduler ------------------------------------------------------------
def make(cls, **kw):
    return cls(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
               eos_token_ids=(EOS_ID,), **kw)


def result(plan, token=9):
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    return StepResult(plan.step, sampled, (token,) * len(sampled), 0.0)


def test_how_many_steps_each_variant_keeps_in_flight():
    assert Scheduler.max_in_flight == 1 and AsyncScheduler.max_in_flight == 2


def test_the_plain_scheduler_refuses_to_plan_ahead():
    s = make(Scheduler)
    s.add(rendered("a", (1, 2, 3), max_tokens=4))
    s.schedule()
    with pytest.raises(RuntimeError, match="at most 1"):
        s.schedule()


def test_async_plans_the_next_decode_with_a_placeholder():
    s = make(AsyncScheduler)
    s.add(rendered("a", (1, 2, 3), max_tokens=3))
    first = s.schedule()
    second = s.schedule()                     # planned before the first comes back
    (c1,), (c2,) = first.chunks, second.chunks
    assert c1.token_ids == (1, 2, 3) and c1.sample
    assert c2.token_ids == (PLACEHOLDER,) and c2.start_pos == 3 and c2.sample
    assert s.by_id["a"].num_pending == 2
    with pytest.raises(RuntimeError, match="at most 2"):
        s.schedule()
    out1 = s.update(first, result(first, 5))
    assert s.by_id["a"].num_pending == 1 and s.by_id["a"].token_ids == [1, 2, 3, 5]
    third = s.schedule()                      # the last token is on its way: max_tokens 3
    assert third.chunks[0].token_ids == (PLACEHOLDER,)
    out2 = s.update(second, result(second, 6))
    # the third token is on its way and ends the sequence by length: nothing more planned
    assert not s.schedule().chunks
    out3 = s.update(third, result(third, 7))
    toks = [t for out in (out1, out2, out3) for d in out.deltas for t in d.token_ids]
    assert toks == [5, 6, 7] and out3.deltas[-1].finish_reason == FinishReason.LENGTH
    assert s.blocks.num_used == 0


def test_async_driven_in_lockstep_plans_as_the_plain_scheduler():
    """One step at a time, AsyncScheduler plans no placeholder and gives the same plans and
    deltas as Scheduler (time fields aside)."""
    def trace(cls):
        s = make(cls)
        s.add(rendered("a", (1, 2, 3, 4, 5), max_tokens=6, stop_token_ids=(8,)))
        s.add(rendered("b", (1, 2, 3), max_tokens=4, body={"n": 2}))
        out = []
        for i in range(40):
            if not s.has_work():
                break
            plan = s.schedule()
            step = s.update(plan, result(plan, 8 if i == 4 else 10 + i))
            out.append((plan, [attrs.evolve(d, scheduled_at=0.0) for d in step.deltas]))
        return out
    plain = trace(Scheduler)
    assert plain == trace(AsyncScheduler)
    assert all(PLACEHOLDER not in c.token_ids for plan, _ in plain for c in plan.chunks)


# -- the stage wakes when a grammar has compiled ---------------------------------------------
class SlowCompiler(ConstraintCompiler):
    """A compile that takes `delay` seconds in a thread (or never ends, with None)."""

    def __init__(self, delay: float | None) -> None:
        self.delay = delay

    def submit(self, constraint: Constraint) -> Future:
        fut: Future = Future()
        if self.delay is not None:
            threading.Timer(self.delay, fut.set_result, ("compiled",)).start()
        return fut


class CountingScheduler(Scheduler):
    plans = 0

    def schedule(self):
        self.plans += 1
        return super().schedule()


def constrained(rid, **kw):
    req = rendered(rid, (1, 2, 3), **kw)
    return attrs.evolve(req, sampling=attrs.evolve(req.sampling,
                                                   constraint=Constraint("regex", "a+")))


async def run_schedule(sched, script):
    """schedule.run with a scripted runner; `script(inbox_send)` feeds the inbox. The
    deltas that came downstream."""
    inbox_send, inbox = trio.open_memory_channel(8)
    plan_send, plan_recv = trio.open_memory_channel(0)
    res_send, res_recv = trio.open_memory_channel(0)
    down_send, down_recv = trio.open_memory_channel(64)
    deltas = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(gpu_step.run, plan_recv, res_send, ScriptedRunner(lambda sid, k: 10 + k))
            n.start_soon(schedule.run, inbox, plan_send, res_recv, down_send, sched)
            async with inbox_send:
                await script(inbox_send)
            async with down_recv:
                async for step in down_recv:
                    deltas.extend(step.deltas)
    return deltas


async def test_the_stage_sleeps_until_the_grammar_is_compiled():
    """A 0.2 s compile: the stage plans a handful of empty steps, not one per millisecond,
    and runs the request once the grammar is ready."""
    sched = CountingScheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64,
                              max_model_len=64, eos_token_ids=(EOS_ID,), grammars=SlowCompiler(0.2))

    async def script(inbox):
        await inbox.send(constrained("a", max_tokens=2))
    t0 = trio.current_time()
    deltas = await run_schedule(sched, script)
    assert trio.current_time() - t0 >= 0.2
    assert [t for d in deltas for t in d.token_ids] == [10, 11]
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert sched.plans < 10, sched.plans


async def test_a_message_wakes_the_stage_while_a_grammar_compiles():
    sched = CountingScheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64,
                              max_model_len=64, eos_token_ids=(EOS_ID,), grammars=SlowCompiler(None))

    async def script(inbox):
        await inbox.send(constrained("a", max_tokens=2))
        await trio.sleep(0.1)
        await inbox.send(Abort("a"))
    deltas = await run_schedule(sched, script)
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", FinishReason.ABORT)]
    assert sched.plans < 10, sched.plans


def test_the_schedule_package_imports_without_torch():
    import subprocess
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'triton', 'xgrammar'):\n"
            "            raise ImportError(name + ' is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import stages.schedule\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_update_one_token_rows_finish_as_the_general_path(cls):
    """update's straight-line row (stages/schedule/rows.py: one sampled token, no logprobs)
    against the general row (the same requests asking for logprobs, which takes the other
    path): the same tokens, finishes and stop reasons for EOS, a stop token id, max_tokens,
    max_model_len and a token that stops nothing."""
    cases = {"eos": ((1, 2, 3), {"max_tokens": 4}, EOS_ID),
             "stop_id": ((1, 2, 3), {"max_tokens": 4, "stop_token_ids": (7,)}, 7),
             "length": ((1, 2, 3), {"max_tokens": 1}, 5),
             "model_len": (tuple(range(1, 64)), {"max_tokens": 100}, 5),
             "goes_on": ((1, 2, 3), {"max_tokens": 4}, 5)}

    def run(logprobs):
        out = {}
        for name, (prompt, kw, token) in cases.items():
            s = make(cls)
            s.add(rendered(name, prompt, **kw))
            plan = s.schedule()
            sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
            lps = ((None,) * len(sampled)) if logprobs else ()
            step = s.update(plan, StepResult(plan.step, sampled, (token,) * len(sampled), 0.0,
                                             logprobs=lps))
            (d,) = step.deltas
            out[name] = (d.token_ids, d.finish_reason, d.stop_reason, s.by_id.get(name) is None,
                         step.num_running)
        return out

    fast, general = run(False), run(True)
    assert fast == general
    assert fast["eos"][1:3] == (FinishReason.STOP, None)
    assert fast["stop_id"][1:3] == (FinishReason.STOP, 7)
    assert fast["length"][1] == fast["model_len"][1] == FinishReason.LENGTH
    assert fast["goes_on"][1] is None and not fast["goes_on"][3]
