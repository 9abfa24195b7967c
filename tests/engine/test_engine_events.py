"""The event log in process: reasoning replays from the header alone, a changed reasoning
parser is named as the first differing stage, and preemptions reach the timeline (the
log's own writing and reading, rotation and redaction: tests/pipeline/test_events.py)."""
from __future__ import annotations

import trio

from pipeline.tools import timeline
from pipeline.core.events import event_files
from pipeline.tools.replay import Log, replay_log
from tests.support.smollm_engine import QUESTION, engine_of


async def _record(smollm, log, **cfg) -> dict[str, bytes]:
    seen: dict[str, bytes] = {}

    async def raw(api: str, **body) -> None:
        reply = await engine.submit(api, {"model": engine.model_names[0], **body})
        seen[reply.request_id] = await reply.read()

    async with engine_of(smollm, event_log=str(log), **cfg) as engine:
        async with trio.open_nursery() as reqs:
            reqs.start_soon(lambda: raw("chat", messages=QUESTION, max_tokens=6, stream=True,
                                        temperature=0))
            reqs.start_soon(lambda: raw("responses", input="Say hi", max_output_tokens=5,
                                        temperature=0))
            reqs.start_soon(lambda: raw("chat", messages=QUESTION, max_tokens=5, n=2, seed=1,
                                        temperature=1.0))
            reqs.start_soon(lambda: raw("chat", messages=QUESTION, max_tokens=4, n=2,
                                        use_beam_search=True, stream=True))   # issue 37
    return seen


async def test_reasoning_replays_from_the_header_and_a_changed_parser_is_named(smollm, tmp_path):
    log = tmp_path / "events.jsonl"
    seen = await _record(smollm, log, reasoning_parser="deepseek_r1")
    assert any(b'"reasoning' in body for body in seen.values())
    events = Log.read(log)
    assert events.header["flags"]["reasoning_parser"] == "deepseek_r1"
    same = replay_log(events, smollm.tokenizer, events.header["flags"]["reasoning_parser"])
    assert same.reproduced == same.logged == seen and not same.differences

    changed = replay_log(events, smollm.tokenizer, None)     # the parser changed on purpose
    assert {d.request_id for d in changed.differences} == set(seen)
    for d in changed.differences:
        assert d.stage == "parse" and "logged" in d.stage_detail
        assert d.expected != d.got and d.expected in seen[d.request_id]


async def test_preemptions_and_steps_reach_the_timeline(smollm, tmp_path):
    log = tmp_path / "events.jsonl"
    seen: dict[str, bytes] = {}

    async def raw(prompt: str) -> None:
        reply = await engine.submit("completions", {
            "model": engine.model_names[0], "prompt": prompt, "max_tokens": 24,
            "ignore_eos": True, "temperature": 0})
        seen[reply.request_id] = await reply.read()

    # 4 blocks of 16 tokens; each request needs 2 (a ~7-token prompt and 24 tokens): the
    # newest running one is preempted when the others grow
    async with engine_of(smollm, event_log=str(log), num_gpu_blocks_override=4, block_size=16,
                         event_log_max_bytes=20_000, event_log_backup_count=50) as engine:
        async with trio.open_nursery() as reqs:
            for prompt in ("Once upon a time there was", "The capital of France is a city",
                           "In the beginning the universe"):
                reqs.start_soon(raw, prompt)
        preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0 and len(event_files(log)) > 1
    events = Log.read(log)
    tl = timeline.build(events)
    assert {r.request_id for r in tl.requests} == set(seen)
    assert sum(len(r.preemptions) for r in tl.requests) == preemptions
    assert all(r.end >= r.last_token >= r.first_token >= r.first_scheduled >= r.received
               for r in tl.requests)
    assert tl.steps and max(s.kv_used for s in tl.steps) <= 4 and max(s.batch for s in tl.steps) > 1
    text = timeline.text(tl)
    assert all(rid in text for rid in seen) and "preempted x" in text
    page = timeline.html(tl)
    assert page.count('"request_id"') == len(seen) and "<script" in page
    result = replay_log(events, smollm.tokenizer)       # preempted and rotated: still identical
    assert result.reproduced == result.logged == seen
