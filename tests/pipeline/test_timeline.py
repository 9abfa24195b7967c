"""pipeline/tools/timeline.py on a small synthetic event log: per request its times, durations,
tokens and outcome; per engine step its batch, tokens and KV use; the text table and the
HTML page. (A real log with preemptions: tests/engine/test_engine_events.py; the page in
a browser: tests/e2e/test_e2e_events.py.)"""
from __future__ import annotations

import re

import orjson
import pytest

from pipeline.tools import timeline
from pipeline.tools.replay import Log

T0 = 1000.0          # the header's monotonic t: every time is relative to it


def scheduled(t, step, chunks, deltas, new=(), preempted=(), **msg):
    return {"event": "scheduled", "stage": "schedule", "t": t,
            "plan": {"step": step, "chunks": chunks, "new_seqs": []},
            "preempted": list(preempted),
            "message": {"step": step, "new_requests": list(new), "deltas": deltas,
                        "done_at": t, **msg}}


def new(rid, api, stream, n=1, arrival=None):
    return {"request_id": rid, "api": api, "stream": stream, "n": n, "arrival": arrival}


EVENTS = [
    {"event": "header", "stage": "engine", "t": T0, "wall_time": 1_700_000_000.0,
     "kv_blocks_total": 8, "model_name": "tiny", "tailrace_version": "0.test"},
    # a: a chat stream, 10-token prompt, two tokens, ends by length
    {"event": "received", "stage": "render", "t": T0 + 0.3, "request_id": "a", "api": "chat",
     "arrival": T0 + 0.25, "body": {"stream": True}},
    {"event": "admitted", "stage": "admit", "t": T0 + 0.4, "request_id": "a"},
    # b: refused at render
    {"event": "rejected", "stage": "render", "t": T0 + 0.45, "request_id": "b", "status": 400,
     "message": "bad field"},
    {"event": "step", "stage": "gpu_step", "t": T0 + 0.9, "step": 1, "duration_s": 0.25},
    scheduled(T0 + 1.0, 1, [["a", 0, 10, True], ["c#0", 0, 3, False]],
              [{"request_id": "a", "token_ids": [5], "scheduled_at": T0 + 0.5},
               {"request_id": "c", "scheduled_at": T0 + 0.6}],
              new=[new("a", "chat", True), new("c", "completions", False, n=2, arrival=T0 + 0.1)],
              kv_blocks_used=3, num_running=2, num_waiting=1),
    # step 2: a decodes; c's second choice is preempted; its step event comes late
    scheduled(T0 + 1.5, 2, [["a", 10, 1, True], ["c#0", 3, 2, True]],
              [{"request_id": "a", "token_ids": [6], "finish_reason": "length"},
               {"request_id": "c", "token_ids": [7]}],
              preempted=["c#1"], kv_blocks_used=4, num_running=2),
    {"event": "step", "stage": "gpu_step", "t": T0 + 1.55, "step": 2, "duration_s": 0.125},
    {"event": "finished", "stage": "account", "t": T0 + 1.6, "request_id": "a",
     "finish_reason": "length", "prompt_tokens": 10, "completion_tokens": 2,
     "cached_tokens": 0, "reasoning_tokens": 0},
    {"event": "reply_end", "stage": "emit", "t": T0 + 1.7, "request_id": "a", "status": 200},
    # nothing computed, nothing preempted: a step that only finishes c is no step row
    scheduled(T0 + 2.0, 3, [], [{"request_id": "c", "finish_reason": "abort"}]),
    {"event": "finished", "stage": "account", "t": T0 + 2.0, "request_id": "c",
     "finish_reason": "abort", "prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0},
    # d finished, but its non-streaming reply was a 500: failed
    {"event": "received", "stage": "render", "t": T0 + 2.1, "request_id": "d",
     "api": "responses", "arrival": T0 + 2.1, "body": {}},
    {"event": "finished", "stage": "account", "t": T0 + 2.5, "request_id": "d",
     "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0},
    {"event": "reply_end", "stage": "emit", "t": T0 + 2.5, "request_id": "d", "status": 500},
    # e: still waiting when the log ends
    {"event": "received", "stage": "render", "t": T0 + 3.0, "request_id": "e",
     "api": "chat", "arrival": T0 + 3.0},
]


@pytest.fixture
def tl() -> timeline.Timeline:
    return timeline.build(Log(EVENTS[0], EVENTS, []))


def test_request_times_are_seconds_since_the_header(tl):
    a = next(r for r in tl.requests if r.request_id == "a")
    assert (a.api, a.stream, a.n) == ("chat", True, 1)
    assert (a.received, a.queued, a.first_scheduled) == (0.25, 0.4, 0.5)  # arrival, not t
    assert (a.first_token, a.last_token, a.end) == (1.0, 1.5, 1.6)
    assert (a.outcome, a.finish_reason, a.status) == ("finished", "length", 200)
    assert (a.prompt_tokens, a.cached_tokens, a.output_tokens) == (10, 0, 2)
    assert a.durations() == {"queue": 250.0, "prefill": 500.0, "decode": 500.0, "total": 1350.0}


def test_outcomes_and_preemptions(tl):
    by_id = {r.request_id: r for r in tl.requests}
    assert [r.request_id for r in tl.requests] == ["c", "a", "d", "e", "b"]   # by received
    b, c, d, e = by_id["b"], by_id["c"], by_id["d"], by_id["e"]
    assert (b.outcome, b.status, b.error, b.end, b.received) == ("rejected", 400, "bad field",
                                                                 0.45, None)
    assert (c.outcome, c.api, c.n, c.received) == ("aborted", "completions", 2, 0.1)
    assert c.preemptions == [1.5] and (c.first_token, c.last_token) == (1.5, 1.5)
    assert (d.outcome, d.status) == ("failed", 500)
    assert (e.outcome, e.end) == ("unfinished", None)
    assert e.durations() == {"queue": None, "prefill": None, "decode": None, "total": None}


def test_step_rows(tl):
    assert [(s.step, s.t, s.batch, s.tokens, s.prefill_tokens) for s in tl.steps] == [
        (1, 1.0, 2, 13, 13), (2, 1.5, 2, 3, 2)]   # a prefill: several tokens, or no sample
    one, two = tl.steps
    assert (one.duration_s, two.duration_s) == (0.25, 0.125)   # step 2's event came after
    assert (one.kv_used, one.kv_total, one.running, one.waiting) == (3, 8, 2, 1)
    assert (two.preempted, one.preempted) == (1, 0)


def test_the_text_table(tl):
    out = timeline.text(tl)
    lines = out.splitlines()
    assert lines[0].startswith("# t = 0 at 2023-11-14T22:13:20.000+00:00")
    assert lines[-1] == "# 5 requests, 2 engine steps"
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert re.search(r"^a\s+chat/stream\s+0\.250\s+0\.400\s+0\.500\s+1\.000\s+1\.500\s+1\.600"
                     r"\s+250\.0\s+500\.0\s+500\.0\s+1350\.0\s+10\s+0\s+2\s+length$", rows["a"])
    assert rows["c"].startswith("c ") and "completions/n=2" in rows["c"]
    assert rows["c"].endswith("aborted (preempted x1)")
    assert rows["b"].endswith("rejected 400") and rows["d"].endswith("failed 500")
    assert rows["e"].endswith("unfinished") and " - " in rows["e"]


def test_the_html_page_carries_the_data_inline(tl):
    page = timeline.html(tl)
    data = orjson.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>',
                                  page, re.S).group(1))
    assert data["end"] == 3.0 and data["kv_total"] == 8     # the latest time shown (e arrives)
    assert [r["request_id"] for r in data["requests"]] == ["c", "a", "d", "e", "b"]
    assert data["requests"][1]["durations"]["total"] == 1350.0
    assert [s["step"] for s in data["steps"]] == [1, 2]
    assert "tiny &middot; tailrace 0.test" in page and "http" not in page.replace(
        "http://www.w3.org/2000/svg", "")                  # self-contained: no network


def test_a_request_id_cannot_close_the_pages_script():
    events = [{"event": "header", "t": 0.0, "model_name": "<b>m</b>"},
              {"event": "received", "t": 1.0, "request_id": "</script><script>alert(1)"}]
    page = timeline.html(timeline.build(Log(events[0], events, [])))
    assert page.count("</script>") == 2                  # the data's and the code's own
    assert "<\\/script><script>alert(1)" in page and "&lt;b&gt;m&lt;/b&gt;" in page


def test_an_empty_log():
    tl = timeline.build(Log({}, [], []))
    assert tl.requests == [] and tl.steps == [] and tl.wall_time is None
    assert timeline.text(tl).splitlines()[-1] == "# 0 requests, 0 engine steps"
    assert '"end":1.0' in timeline.html(tl)
