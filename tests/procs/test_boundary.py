"""Across the process boundary (--api-server-count 2), a server answers as one process
does: refusals before the 200, a disconnect that frees the request's blocks in the
engine, stop strings found by a frontend ending the sequence in the engine (same bytes
and usage as one process), and /metrics summed over every process."""
from __future__ import annotations

import subprocess
import sys

import orjson
import httpx

from tests.support.serve_processes import metrics, on_new_connection, scrape_on_new_connection, start, wait_for

PROMPT = "The capital of France is"


def _events(body: bytes) -> list:
    """The SSE events, each JSON one without what differs between runs (id, created)."""
    out = []
    for block in body.split(b"\n\n"):
        if not block.startswith(b"data: "):
            continue
        data = block[len(b"data: "):]
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        event = orjson.loads(data)
        event.pop("id", None)
        event.pop("created", None)
        out.append(event)
    return out


def _idle(url: str) -> dict:
    """Wait until the engine runs nothing and holds no KV block; its metrics then."""
    def idle():
        m = metrics(url)
        return m if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                     and m["tailrace:kv_blocks_used"] == 0) else None
    return wait_for(idle, 60, "the engine to be idle with every block free")


def test_stop_strings_bytes_and_usage_are_those_of_one_process(two_frontends, one_process):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": ["answer"]}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    got = {}
    for name, server in (("split", two_frontends), ("one", one_process)):
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        s = httpx.post(f"{server.url}/v1/completions", json=streamed, timeout=120)
        assert r.status_code == s.status_code == 200
        whole = r.json()
        got[name] = (whole["choices"], whole["usage"], _events(s.content))
    assert got["split"] == got["one"]
    choices, usage, events = got["split"]
    assert choices[0]["finish_reason"] == "stop" and choices[0]["stop_reason"] == "answer"
    assert "answer" not in choices[0]["text"]
    assert usage["completion_tokens"] < 24          # the engine stopped at the stop string
    assert events[-1] == "[DONE]" and events[-2]["usage"] == usage
    _idle(two_frontends.url)


def test_refusals_come_before_the_200(two_frontends):
    url = two_frontends.url
    too_long = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"prompt": "hello " * 600, "max_tokens": 4})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["type"] == "invalid_request_error"
    # 2 running + 1 queued is all the engine admits, whichever frontend they came by
    long = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as a, httpx.Client(timeout=120) as b, \
            httpx.Client(timeout=120) as c:
        streams = [client.stream("POST", f"{url}/v1/completions", json=long)
                   for client in (a, b, c)]
        opened = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in opened] == [200, 200, 200]
            refused = [httpx.post(f"{url}/v1/completions", json=long, timeout=120)
                       for _ in range(2)]     # new connections: each frontend in turn
            for r in refused:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "server_overloaded"
                assert r.headers["retry-after"] == "1"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    _idle(url)
    # the aborted requests give their admission back once their last deltas have left
    # the engine, a moment after the scheduler's gauges drop
    wait_for(lambda: httpx.post(f"{url}/v1/completions", timeout=120,
                                json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200,
             30, "a request to be admitted again")


def test_a_disconnect_aborts_the_request_in_the_engine_and_frees_its_blocks(two_frontends):
    url = two_frontends.url
    before = _idle(url)
    long = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{url}/v1/completions", json=long) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert metrics(url)["tailrace:kv_blocks_used"] > 0
    _idle(url)
    aborted = 'tailrace:requests_finished_total{finished_reason="abort"}'
    # the frontend counts the abort once the engine's last delta has reached it
    after = wait_for(lambda: (lambda m: m if m[aborted] == before[aborted] + 1 else None)(
        metrics(url)), 30, "the abort to be counted")
    assert after["vllm:generation_tokens_total"] < before["vllm:generation_tokens_total"] + 400


def test_metrics_add_up_over_the_processes(two_frontends):
    url = two_frontends.url
    before = _idle(url)["vllm:generation_tokens_total"]
    made = 0
    for i in range(6):      # a connection each: the kernel spreads them over the frontends
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": f"{PROMPT} {i}", "max_tokens": 3 + i % 3})
        made += r.json()["usage"]["completion_tokens"]
    # whichever frontend the kernel hands a scrape to, it answers the sum over all of
    # them; new connections until each frontend has answered at least one (the pid that
    # accepted each scrape's connection, from /proc)
    frontends = set(two_frontends.children()["frontend"])
    assert len(frontends) == 2
    answered: list[int] = []
    while set(answered) != frontends:
        assert len(answered) < 40, f"one frontend answered every scrape: {answered}"
        pid, m = scrape_on_new_connection(two_frontends)
        assert m["vllm:generation_tokens_total"] == before + made, (pid, answered)
        answered.append(pid)


def _loads_torch(pid: int) -> bool:
    from pathlib import Path
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_structured_output_is_checked_in_the_engine_and_frontends_stay_torch_free(two_frontends):
    """xgrammar imports torch: the constraint is checked by admit, in the engine, so a
    bad regex is still a 400 naming its field and the frontends never load torch."""
    url = two_frontends.url
    for _ in range(2):      # a connection each: both frontends, in the kernel's turn
        bad = httpx.post(f"{url}/v1/completions", timeout=120,
                         json={"prompt": "x", "max_tokens": 4, "guided_regex": "(unclosed"})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "guided_regex"
        assert "is not a valid regex" in bad.json()["error"]["message"]
        good = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"prompt": "The year is", "max_tokens": 10,
                                "structured_outputs": {"regex": r" \d{4}"}})
        assert good.status_code == 200, good.text
        text = good.json()["choices"][0]["text"]
        assert len(text) == 5 and text[1:].isdigit()
    kids = two_frontends.children()
    assert len(kids["frontend"]) == 2 and kids["engine"]
    assert [_loads_torch(pid) for pid in kids["frontend"]] == [False, False]
    assert _loads_torch(kids["engine"][0])        # the check is not vacuous


def test_the_event_log_one_file_a_process_replays_and_joins(tmp_path):
    """A server of its own, stopped here so that every line is written (stopping the
    module's would make the tests after it depend on the order)."""
    server = start(tmp_path, "--api-server-count", "2", "--event-log", str(tmp_path / "events.jsonl"))
    try:
        url = server.url
        frontends = set(server.children()["frontend"])
        served: set[int] = set()
        # a connection each: the kernel picks the frontend (a second one that binds late
        # gets none of the first few), so past the ten, until both have served one
        for i in range(40):
            if i >= 10 and served == frontends:
                break
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 4 + i % 3, "temperature": 0}
            if i % 2:
                body.update(stream=True, stop=["the"], logprobs=1)
            if i == 4:
                body["structured_outputs"] = {"regex": r" \d{4}"}
            pid, status, text = on_new_connection(server, "POST", "/v1/completions",
                                                  orjson.dumps(body), timeout=120)
            assert status == 200, text
            served.add(pid)
        assert served == frontends, served
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "seed": 1})
        assert chat.status_code == 200, chat.text
    finally:
        code = server.stop()
    assert code == 0
    log = server.event_log
    parts = sorted(log.parent.glob("events.jsonl.frontend-*"))
    assert [p.name for p in parts] == ["events.jsonl.frontend-0", "events.jsonl.frontend-1"]
    headers = [orjson.loads(p.read_bytes().split(b"\n", 1)[0]) for p in (log, *parts)]
    assert all(h["event"] == "header" for h in headers)
    assert len({orjson.dumps({k: v for k, v in h.items() if k not in ("t", "wall_time")})
                for h in headers}) == 1               # the same header in every file
    replay = subprocess.run([sys.executable, "-m", "web.cli", "replay", str(log)],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    line = next(ln for ln in replay.stdout.splitlines() if ln.startswith("replayed"))
    checked = int(line.split()[1])
    assert checked >= 10 and line.endswith(f"{checked} identical, 0 differ")
    page = tmp_path / "run.html"
    html = subprocess.run([sys.executable, "-m", "web.cli", "replay", str(log), "--timeline",
                           "--html", str(page)], capture_output=True, text=True, timeout=300)
    assert html.returncode == 0, html.stderr
    rows = [ln for ln in html.stdout.splitlines() if ln[:2] in ("0:", "1:")]
    assert len(rows) >= checked                        # every frontend's requests, joined
    assert {ln[:2] for ln in rows} == {"0:", "1:"}
    assert page.stat().st_size > 1000


def _on_each_frontend(server, method: str, path: str, body: bytes | None = None) -> dict:
    """The request on new connections until each frontend has answered one: pid -> (status,
    body) of its last answer."""
    frontends = set(server.children()["frontend"])
    answers: dict[int, tuple[int, str]] = {}
    for _ in range(40):
        pid, status, text = on_new_connection(server, method, path, body, timeout=120)
        answers[pid] = (status, text)
        if set(answers) == frontends:
            return answers
    raise AssertionError(f"one frontend answered every request: {answers}")


def test_control_routes_work_across_the_frontends(two_frontends):
    """Issue 37: /reset_prefix_cache, /sleep and /wake_up on any frontend act on the
    engine; while it sleeps every frontend says so and refuses generation with 503, and
    after the wake-up the answers are those from before (vLLM serves these with several
    API servers too)."""
    body = orjson.dumps({"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    before = httpx.post(f"{two_frontends.url}/v1/completions", content=body, timeout=120,
                        headers={"Content-Type": "application/json"}).json()
    for status, text in _on_each_frontend(two_frontends, "POST", "/reset_prefix_cache").values():
        assert (status, text) == (200, "")
    assert httpx.post(f"{two_frontends.url}/sleep?level=1", timeout=120).status_code == 200
    for status, text in _on_each_frontend(two_frontends, "GET", "/is_sleeping").values():
        assert (status, orjson.loads(text)) == (200, {"is_sleeping": True})
    for status, text in _on_each_frontend(two_frontends, "POST", "/v1/completions",
                                          body).values():
        assert status == 503 and orjson.loads(text)["error"]["code"] == "engine_sleeping"
    assert httpx.post(f"{two_frontends.url}/wake_up", timeout=120).status_code == 200
    for status, text in _on_each_frontend(two_frontends, "GET", "/is_sleeping").values():
        assert (status, orjson.loads(text)) == (200, {"is_sleeping": False})
    for status, text in _on_each_frontend(two_frontends, "POST", "/v1/completions",
                                          body).values():
        assert status == 200
        assert orjson.loads(text)["choices"][0]["text"] == before["choices"][0]["text"]
