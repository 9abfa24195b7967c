"""Every stage, run alone through the harness with scripted input messages."""
from __future__ import annotations

import attrs
import orjson
import trio

from pipeline.tools.harness import Recorder, ScriptedRunner, run_stage
from stages import account, admit, detokenize, emit, gpu_step, parse, render, schedule
from stages.admit import Accepted, Admission
from stages.schedule.blocks import BlockManager
from stages.delta import Delta, FinishReason, Usage
from tests.support.rendered import rendered as make_rendered
from stages.messages import Abort, FinishRequest, RenderedRequest, SamplingParams, Step, Submission
from stages.render import RenderContext, RequestError
from stages.replies import Replies
from stages.schedule import Scheduler


def rendered(rid="r1", prompt=(1, 2, 3), api="chat", stream=True, **sampling) -> RenderedRequest:
    return make_rendered(rid, prompt, api, stream=stream, **sampling)


# -- render ----------------------------------------------------------------------------------
async def test_render_stage_renders_and_rejects(smollm_tokenizer):
    ctx = RenderContext(tokenizer=smollm_tokenizer, served_model_names=("m",), max_model_len=64)
    replies = Replies(8)
    good = Submission("a", "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 4}, 0.0)
    bad = Submission("b", "chat", {"model": "m", "messages": [], "max_tokens": 4}, 0.0)
    inbox_b = replies.open("b")
    log = Recorder()
    out = await run_stage(render.run, inputs={"receive": [good, bad]}, outputs=("send",),
                          replies=replies, ctx=ctx, log=log)
    [req] = out["send"]
    assert req.request_id == "a" and req.sampling.max_tokens == 4
    assert req.prompt_token_ids == tuple(smollm_tokenizer.encode(
        smollm_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])))
    err = inbox_b.receive_nowait()
    assert isinstance(err, RequestError) and err.status == 400
    assert [e["request_id"] for e in log.named("rejected")] == ["b"]


# -- admit -----------------------------------------------------------------------------------
async def test_admit_stage_forwards_and_refuses():
    replies = Replies(8)
    chans = {rid: replies.open(rid) for rid in ("ok", "huge", "gone")}
    replies.detach("gone")
    core = Admission(max_admitted=10, kv_capacity_tokens=32, admitted=lambda: replies.num_admitted)
    reqs = [rendered("ok"), rendered("huge", prompt=range(30)), rendered("gone")]
    out = await run_stage(admit.run, inputs={"receive": reqs}, outputs=("schedule",),
                          replies=replies, core=core)
    assert [r.request_id for r in out["schedule"]] == ["ok"]
    assert chans["ok"].receive_nowait() == Accepted("ok", True)
    err = chans["huge"].receive_nowait()
    assert isinstance(err, RequestError) and "KV cache" in err.message


async def test_admit_refuses_when_overloaded():
    """The limit counts admitted requests: ones still being rendered do not take a slot."""
    replies = Replies(8)
    chans = {rid: replies.open(rid) for rid in ("a", "b", "c", "d")}
    core = Admission(max_admitted=2, kv_capacity_tokens=1000, admitted=lambda: replies.num_admitted)
    out = await run_stage(admit.run, inputs={"receive": [rendered(r) for r in "abc"]},
                          outputs=("schedule",), replies=replies, core=core)
    assert [r.request_id for r in out["schedule"]] == ["a", "b"]
    assert replies.num_admitted == 2 and "c" not in replies
    err = chans["c"].receive_nowait()
    assert isinstance(err, RequestError) and err.status == 503 and err.code == "server_overloaded"
    replies.release("a")                       # emit let go of one: its slot is free again
    assert replies.num_admitted == 1 and core.refusal() is None


async def test_admit_refuses_everything_once_draining():
    replies = Replies(8)
    chan = replies.open("a")
    core = Admission(max_admitted=2, kv_capacity_tokens=1000, admitted=lambda: replies.num_admitted)
    core.draining = True
    out = await run_stage(admit.run, inputs={"receive": [rendered("a")]}, outputs=("schedule",),
                          replies=replies, core=core)
    assert out["schedule"] == []
    err = chan.receive_nowait()
    assert err.status == 503 and err.code == "server_shutting_down"


# -- schedule + gpu step ---------------------------------------------------------------------
async def test_schedule_stage_runs_requests_to_completion():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=64, eos_token_ids=(0,))
    runner = ScriptedRunner(lambda sid, n: 10 + n)
    reqs = [rendered("a", max_tokens=3), rendered("b", prompt=(5, 6), max_tokens=2)]
    plan_send, plan_recv = trio.open_memory_channel(0)
    res_send, res_recv = trio.open_memory_channel(0)
    async with trio.open_nursery() as n:
        n.start_soon(gpu_step.run, plan_recv, res_send, runner)
        out = await run_stage(schedule.run, inputs={"inbox": reqs}, outputs=("downstream",),
                              to_gpu=plan_send, from_gpu=res_recv, scheduler=sched)
    steps = out["downstream"]
    assert {r.request_id for r in steps[0].new_requests} == {"a", "b"}
    tokens: dict[str, list[int]] = {}
    finish = {}
    for s in steps:
        for d in s.deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                finish[d.request_id] = d.finish_reason
    assert tokens == {"a": [10, 11, 12], "b": [10, 11]}
    assert finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert sched.blocks.num_used == 0


async def test_schedule_stage_abort_frees_blocks():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=64, eos_token_ids=(0,))
    runner = ScriptedRunner(lambda sid, n: 7)
    plan_send, plan_recv = trio.open_memory_channel(0)
    res_send, res_recv = trio.open_memory_channel(0)
    async with trio.open_nursery() as n:
        n.start_soon(gpu_step.run, plan_recv, res_send, runner)
        out = await run_stage(schedule.run, inputs={"inbox": [rendered("a", max_tokens=50), Abort("a")]},
                              outputs=("downstream",), to_gpu=plan_send, from_gpu=res_recv,
                              scheduler=sched)
    finishes = [d for s in out["downstream"] for d in s.deltas if d.finished]
    assert [(d.request_id, d.finish_reason) for d in finishes] == [("a", FinishReason.ABORT)]
    assert sched.blocks.num_used == 0 and not sched.running


# -- detokenize ------------------------------------------------------------------------------
async def test_detokenize_stage_text_and_stop_string(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("Paris is nice. Stop here please")
    req = rendered("a", prompt=tok.encode("Q:"), stop=("Stop",))
    steps = [Step(1, (req,), (Delta("a", tuple(ids[:3])),))]
    steps += [Step(i + 2, (), (Delta("a", (t,)),)) for i, t in enumerate(ids[3:])]
    out = await run_stage(detokenize.run, inputs={"receive": steps}, outputs=("send", "control"),
                          core=detokenize.Detokenizer(tok))
    deltas = [d for s in out["send"] for d in s.deltas]
    assert "".join(d.text for d in deltas) == "Paris is nice. "
    assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_reason == "Stop"
    assert out["control"] == [FinishRequest("a")]


def _one_token_steps(req, ids) -> list[Step]:
    return [Step(i + 1, (req,) if i == 0 else (), (Delta(req.request_id, (t,)),))
            for i, t in enumerate(ids)]


async def test_detokenize_stop_string_waits_for_min_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("a b a b a b c")       # one token per letter (with its space)
    assert len(ids) == 7
    # Without min_tokens the first "b" stops it; with min_tokens=3 the stop string has to
    # end in the text of the 4th token or later (vLLM's rule): the "b" at token 4.
    for min_tokens, expect_text, expect_tokens in ((0, "a", 2), (3, "a b a", 4),
                                                  (4, "a b a b a", 6)):
        req = rendered("a", prompt=tok.encode("Q:"), stop=(" b",), min_tokens=min_tokens)
        out = await run_stage(detokenize.run, inputs={"receive": _one_token_steps(req, ids)},
                              outputs=("send", "control"), core=detokenize.Detokenizer(tok))
        deltas = [d for s in out["send"] for d in s.deltas]
        assert "".join(d.text for d in deltas) == expect_text, min_tokens
        assert len(deltas) == expect_tokens
        assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_reason == " b"
        assert out["control"] == [FinishRequest("a")]


async def test_detokenize_stop_string_straddling_min_tokens(smollm_tokenizer):
    # A stop string may start in the text of the first min_tokens tokens, as long as it
    # ends after them.
    tok = smollm_tokenizer
    ids = tok.encode("x y z")
    assert len(ids) == 3
    req = rendered("a", prompt=tok.encode("Q:"), stop=("x y",), min_tokens=1)
    out = await run_stage(detokenize.run, inputs={"receive": _one_token_steps(req, ids)},
                          outputs=("send", "control"), core=detokenize.Detokenizer(tok))
    deltas = [d for s in out["send"] for d in s.deltas]
    assert "".join(d.text for d in deltas) == ""
    assert deltas[-1].stop_reason == "x y" and len(deltas) == 2


async def test_detokenize_hides_eos_but_counts_it(smollm_tokenizer):
    tok = smollm_tokenizer
    eos = tok.eos_token_ids[0]
    hello = tok.encode("Hello")
    steps = [Step(1, (rendered("a"),), (Delta("a", tuple(hello)),)),
             Step(2, (), (Delta("a", (eos,), FinishReason.STOP),))]
    out = await run_stage(detokenize.run, inputs={"receive": steps}, outputs=("send", "control"),
                          core=detokenize.Detokenizer(tok))
    deltas = [d for s in out["send"] for d in s.deltas]
    assert "".join(d.text for d in deltas) == "Hello"
    assert deltas[-1].token_ids == (eos,) and deltas[-1].finish_reason == FinishReason.STOP
    assert out["control"] == []


# -- parse -----------------------------------------------------------------------------------
def _text_steps(rid: str, pieces: list[str]) -> list[Step]:
    req = rendered(rid)
    out = []
    for i, p in enumerate(pieces):
        fin = FinishReason.STOP if i == len(pieces) - 1 else None
        out.append(Step(i, (req,) if i == 0 else (), (Delta(rid, (i,), fin, text=p),)))
    return out


async def test_parse_stage_splits_reasoning_across_split_tags():
    steps = _text_steps("a", ["<th", "ink>plan", " it</th", "ink>\n\nAnswer", "!"])
    out = await run_stage(parse.run, inputs={"receive": steps}, core=parse.Parser("qwen3"))
    deltas = [d for s in out["send"] for d in s.deltas]
    assert "".join(d.reasoning for d in deltas) == "plan it"
    assert "".join(d.content for d in deltas) == "\n\nAnswer!"


async def test_parse_stage_passthrough_without_parser():
    steps = _text_steps("a", ["<think>x</think>", "y"])
    out = await run_stage(parse.run, inputs={"receive": steps}, core=parse.Parser(None))
    deltas = [d for s in out["send"] for d in s.deltas]
    assert "".join(d.content for d in deltas) == "<think>x</think>y"
    assert all(d.reasoning == "" for d in deltas)


# -- account ---------------------------------------------------------------------------------
async def test_account_stage_usage_and_counters():
    req = rendered("a", prompt=(1, 2, 3, 4))
    steps = [Step(1, (req,), (Delta("a", (5,), num_cached_tokens=2, reasoning="think"),)),
             Step(2, (), (Delta("a", (6, 7), FinishReason.LENGTH, num_cached_tokens=2,
                                content="hi", reasoning_tokens=1),))]
    core = account.Accountant()
    log = Recorder()
    out = await run_stage(account.run, inputs={"receive": steps}, core=core, log=log)
    last = out["send"][-1].deltas[-1]
    assert last.usage == Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=2, reasoning_tokens=1)
    assert core.generation_tokens_total == 3 and core.prompt_tokens_total == 4
    assert core.finished_total == {FinishReason.LENGTH: 1}
    assert log.named("finished")[0]["completion_tokens"] == 3


async def test_account_usage_so_far_only_where_a_reply_reads_it():
    """A running delta gets the usage so far only when its stream shows continuous usage
    stats; every other running delta passes through account as it came."""
    plain = rendered("p", prompt=(1, 2), stream=True)
    cont = attrs.evolve(rendered("c", prompt=(1, 2, 3), stream=True), continuous_usage=True)
    steps = [Step(k, (plain, cont) if k == 0 else (), tuple(
        Delta(rid, (10 + k,), FinishReason.LENGTH if k == 2 else None) for rid in ("p", "c")))
        for k in range(3)]
    out = await run_stage(account.run, inputs={"receive": steps}, core=account.Accountant())
    got = {(d.request_id, s.step): d for s in out["send"] for d in s.deltas}
    for k in range(2):
        assert got["p", k] is steps[k].deltas[0]          # passed on untouched
        assert got["c", k].usage == Usage(prompt_tokens=3, completion_tokens=k + 1)
    assert got["p", 2].usage == Usage(prompt_tokens=2, completion_tokens=3)
    assert got["c", 2].usage == Usage(prompt_tokens=3, completion_tokens=3)


async def test_reasoning_tokens_are_counted_per_token_over_each_choices_output():
    """parse then account: a choice's reasoning tokens are the output tokens inside its
    reasoning, whatever each delta shows. A token whose text detokenize holds back (half a
    character: "") is still reasoning; the tags' own tokens are not. Counting the tokens of
    the deltas that show reasoning would find 2 + 1 here, not 3 + 2."""
    req = rendered("a", body={"n": 2})
    texts = {0: ["<think>", "plan", "", "ning", "</think>", "Answer"],
             1: ["<think>", "x", "", "</think>", "y"]}
    steps, tok = [], 10
    for k in range(max(map(len, texts.values()))):
        deltas = []
        for i, pieces in texts.items():
            if k < len(pieces):
                last = k == len(pieces) - 1
                deltas.append(Delta("a", (tok,), FinishReason.LENGTH if last else None,
                                    index=i, text=pieces[k]))
                tok += 1
        steps.append(Step(k, (req,) if k == 0 else (), tuple(deltas)))
    parsed = await run_stage(parse.run, inputs={"receive": steps}, core=parse.Parser("qwen3"))
    out = await run_stage(account.run, inputs={"receive": parsed["send"]},
                          core=account.Accountant())
    deltas = [d for s in out["send"] for d in s.deltas]
    assert "".join(d.reasoning for d in deltas if d.index == 0) == "planning"
    # each delta its own (a held-back token too); the tags' and the answer's none
    assert [d.reasoning_tokens for d in deltas if d.index == 0] == [0, 1, 1, 1, 0, 0]
    assert [d.reasoning_tokens for d in deltas if d.index == 1] == [0, 1, 1, 0, 0]
    assert all(d.usage is None for d in deltas if not d.finished)   # no reply reads one there
    # the usage so far: when choice 1 ends, choice 0 has made all of its reasoning too
    assert [d.usage.reasoning_tokens for d in deltas if d.finished] == [2 + 3, 2 + 3]
    assert deltas[-1].usage == Usage(prompt_tokens=3, completion_tokens=11,
                                     reasoning_tokens=3 + 2)      # summed over the choices


async def test_continuous_usage_of_several_choices_carries_each_ones_reasoning_tokens():
    """n 2 with continuous usage stats: every delta's usage is its own choice's so far,
    its reasoning tokens included (the seed's test_serving_chat), not the request's sum."""
    req = attrs.evolve(rendered("a", body={"n": 2}, stream=True), continuous_usage=True)
    texts = {0: ["<think>", "a", "b", "c", "</think>", "A"], 1: ["<think>", "x", "</think>", "Y"]}
    steps, tok = [], 10
    for k in range(6):
        deltas = []
        for i, pieces in texts.items():
            if k < len(pieces):
                deltas.append(Delta("a", (tok,), FinishReason.STOP if k == len(pieces) - 1
                                    else None, index=i, text=pieces[k]))
                tok += 1
        steps.append(Step(k, (req,) if k == 0 else (), tuple(deltas)))
    parsed = await run_stage(parse.run, inputs={"receive": steps}, core=parse.Parser("qwen3"))
    out = await run_stage(account.run, inputs={"receive": parsed["send"]},
                          core=account.Accountant())
    deltas = [d for s in out["send"] for d in s.deltas]
    own = {i: [d.usage.choice for d in deltas if d.index == i] for i in texts}
    assert [u.reasoning_tokens for u in own[0]] == [0, 1, 2, 3, 3, 3]
    assert [u.reasoning_tokens for u in own[1]] == [0, 1, 1, 1]
    assert [u.completion_tokens for u in own[1]] == [1, 2, 3, 4]
    # a chunk shows its choice's own (framing's _chunk_usage), beside the request's sum
    assert deltas[4].usage.reasoning_tokens == 3 and deltas[4].usage.choice.reasoning_tokens == 2


# -- emit ------------------------------------------------------------------------------------
async def test_emit_stage_streams_sse_and_closes_reply():
    replies = Replies(16)
    inbox = replies.open("a")
    req = rendered("a", api="completions")
    usage = Usage(3, 2)
    steps = [Step(1, (req,), (Delta("a", (1,), content="Hel", usage=Usage(3, 1)),)),
             Step(2, (), (Delta("a", (2,), FinishReason.STOP, content="lo", usage=usage),))]
    await run_stage(emit.run, inputs={"receive": steps}, outputs=(), replies=replies, core=emit.Emitter())
    items = [x async for x in inbox]
    assert isinstance(items[-1], emit.ReplyEnd) and items[-1].status == 200
    body = b"".join(items[:-1])
    assert body.endswith(b"data: [DONE]\n\n")
    chunks = [orjson.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello"
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert "a" not in replies
