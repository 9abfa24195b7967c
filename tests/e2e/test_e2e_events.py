"""The event log as a product, end to end: a real `tailrace serve --event-log` (rotating)
answers concurrent streaming and non-streaming requests from the official openai client
(chat, completions, Responses, n=2, seeded sampling, logprobs, a tool call, a structured
output, usage options, per-request metrics, an aborted stream, a refused request); then
`tailrace replay` reproduces every reply byte for byte from the log alone, catches a
changed parser and a changed token, and its timeline and page list every request."""
from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import orjson
import pytest

from pipeline.core.events import event_files, read_events
from pipeline.tools.replay import Log, replay_log

KEY = "sk-tailrace-secret-0123456789"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
          "required": ["answer"], "additionalProperties": False}
HEADERS = {"X-Api-Key": KEY, "Cookie": f"session={KEY}", "X-Trace": "visible"}


def _cli(*args: str, capsys=None) -> subprocess.CompletedProcess:
    """`tailrace replay ARGS`: in this process when given capsys (no second torch import on
    a busy machine), else as a subprocess."""
    if capsys is None:
        return subprocess.run([sys.executable, "-m", "web.cli", "replay", *args],
                              capture_output=True, text=True, timeout=120)
    from web.cli import main

    capsys.readouterr()
    rc = main(["replay", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def _raw(make, **kw) -> tuple[str, bytes]:
    """One call through the openai client's raw-response API: (request id, reply bytes)."""
    with make.with_streaming_response.create(**kw, extra_headers=HEADERS) as r:
        return r.headers["x-request-id"], b"".join(r.iter_bytes())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, serve_with_flags):
    """Run the requests against a server with a rotating event log, then stop it."""
    tmp = tmp_path_factory.mktemp("e2e-events-server")
    log = tmp / "events.jsonl"
    serve = serve_with_flags(tmp, "--event-log", str(log), "--event-log-max-bytes", "60KiB",
                   "--event-log-backup-count", "100", "--enable-auto-tool-choice",
                   "--tool-call-parser", "hermes", "--enable-per-request-metrics",
                   "--api-key", KEY)
    server = next(serve)
    try:
        c = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
        chat, comp, resp = c.chat.completions, c.completions, c.responses
        calls = {
            "chat_stream_usage": lambda: _raw(
                chat, model="", messages=ASK, max_tokens=10, stream=True, temperature=0,
                stream_options={"include_usage": True, "continuous_usage_stats": True}),
            "chat_n2_seeded": lambda: _raw(chat, model="", messages=ASK, max_tokens=8, n=2,
                                           seed=5, temperature=1.0),
            "completions_logprobs_stream": lambda: _raw(
                comp, model="", prompt="Once upon a time", max_tokens=8, logprobs=2, seed=3,
                temperature=0.8, stream=True),
            "chat_logprobs": lambda: _raw(chat, model="", messages=ASK, max_tokens=6,
                                          logprobs=True, top_logprobs=2, temperature=0),
            "chat_tool_call_stream": lambda: _raw(
                chat, model="", messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=40, temperature=0, stream=True),
            "chat_structured": lambda: _raw(
                chat, model="", messages=ASK, max_tokens=30, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
            "responses_stream": lambda: _raw(resp, model="", input="Say hi", max_output_tokens=6,
                                             stream=True),
        }
        seen: dict[str, tuple[str, bytes]] = {}
        with concurrent.futures.ThreadPoolExecutor(len(calls) + 1) as pool:
            futures = {pool.submit(fn): name for name, fn in calls.items()}

            def aborted() -> str:
                with chat.with_streaming_response.create(
                        model="", messages=ASK, max_tokens=200, stream=True, temperature=0,
                        extra_headers=HEADERS) as r:
                    chunks = r.iter_bytes()
                    got = next(chunks)
                    while got.count(b"data:") < 3:
                        got += next(chunks)
                    return r.headers["x-request-id"]   # leaving closes the stream: an abort

            abort_future = pool.submit(aborted)
            for f in concurrent.futures.as_completed(futures):
                seen[futures[f]] = f.result()
            aborted_id = abort_future.result()
        # refused in render (a known field's bad value; an unknown field alone is ignored, as
        # vLLM ignores it), its body, secret and all, logged redacted
        with pytest.raises(openai.BadRequestError):
            chat.create(model="", messages=ASK, max_tokens=2, temperature=-1.0,
                        extra_body={"api_key": KEY})
    finally:
        serve.close()   # SIGTERM: the server drains, closes and flushes the log
    return log, seen, aborted_id


def test_the_log_replays_byte_identical_with_no_flags(recorded, capsys):
    log, seen, aborted_id = recorded
    assert len(event_files(log)) > 1                        # it rotated
    events = list(read_events(log))
    header = events[0]
    assert header["event"] == "header" and header["schema_version"] == 1
    assert header["tokenizer_hash"].startswith("sha256:") and header["wall_time"] > 1e9
    assert header["flags"]["tool_call_parser"] == "hermes"
    assert header["flags"]["enable_per_request_metrics"] is True
    for path in event_files(log):                           # every file is self-describing
        assert orjson.loads(path.read_bytes().split(b"\n", 1)[0])["event"] == "header"
    ts = [e["t"] for e in events]
    assert ts == sorted(ts)                                 # monotonic, one clock

    result = replay_log(Log.read(log), _tokenizer())
    for name, (rid, body) in seen.items():
        assert result.logged[rid] == body, name             # the log holds what clients got
        assert result.reproduced[rid] == body, name         # ... and replay reproduces it
    assert b'"tool_calls"' in seen["chat_tool_call_stream"][1]
    assert b'"metrics"' in seen["chat_logprobs"][1]        # timing values, reproduced
    assert result.differences == [] and aborted_id in result.checked
    assert any(e["event"] == "finished" and e["request_id"] == aborted_id
               and e["finish_reason"] == "abort" for e in events)

    cli = _cli(str(log))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert f"replayed {len(seen) + 1} requests: {len(seen) + 1} identical, 0 differ" in cli.stdout
    rid, body = seen["chat_structured"]
    one = _cli(str(log), "--request-id", rid, capsys=capsys)
    assert one.returncode == 0 and one.stdout.endswith(body.decode())


def _tokenizer():
    from gpu.tokenizers.files import load_tokenizer

    return load_tokenizer(None)


def test_secrets_never_reach_the_log(recorded):
    log, _, _ = recorded
    text = b"".join(p.read_bytes() for p in event_files(log))
    assert KEY.encode() not in text
    received = [e for e in read_events(log) if e["event"] == "received"]
    assert received and all(e["headers"]["authorization"] == "[redacted]" for e in received)
    extra = [e["headers"] for e in received if "x-trace" in e["headers"]]
    assert len(extra) == len(received) - 1                  # all but the refused one
    assert all(h["x-api-key"] == h["cookie"] == "[redacted]" for h in extra)
    assert all(h["x-trace"] == "visible" for h in extra)     # other headers are kept
    assert any(e["body"].get("api_key") == "[redacted]" for e in received)


def _copy(log: Path, dest: Path) -> Path:
    for p in event_files(log):
        shutil.copy(p, dest / p.name)
    return dest / log.name


def test_a_changed_parser_is_reported_at_its_first_differing_event(recorded, capsys):
    log, seen, _ = recorded
    cli = _cli(str(log), "--reasoning-parser", "deepseek_r1", capsys=capsys)
    assert cli.returncode == 1
    assert "--reasoning-parser deepseek_r1 overrides the log's none" in cli.stderr
    assert "first differing stage: parse" in cli.stdout
    rid, body = seen["chat_stream_usage"]
    block = cli.stdout[cli.stdout.index(f"request {rid} "):]
    assert "first differing SSE event: #" in block
    expected = re.search(r"expected: (.*)", block).group(1)
    got = re.search(r"got:      (.*)", block).group(1)
    assert expected != got and expected.startswith("data: ") and got.startswith("data: ")
    assert expected in body.decode()


def test_one_changed_token_is_caught(recorded, tmp_path, capsys):
    log, seen, _ = recorded
    copy = _copy(log, tmp_path)
    rid, _ = seen["chat_logprobs"]
    changed = False
    for path in event_files(copy):
        lines = path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if changed or b'"scheduled"' not in line or rid.encode() not in line:
                continue
            ev = orjson.loads(line)
            for d in ev["message"]["deltas"]:
                if d["request_id"] == rid and d.get("token_ids"):
                    d["token_ids"] = [(d["token_ids"][0] + 1) % 1000 + 100]
                    lines[i], changed = orjson.dumps(ev), True
                    break
        path.write_bytes(b"\n".join(lines))
    assert changed
    cli = _cli(str(copy), capsys=capsys)
    assert cli.returncode == 1
    assert "1 differ" in cli.stdout and f"request {rid} (chat, not streaming)" in cli.stdout
    assert "first differing stage: detokenize" in cli.stdout


def test_damaged_and_newer_logs_warn_but_replay(recorded, tmp_path, capsys):
    log, _, _ = recorded
    copy = _copy(log, tmp_path)
    oldest = event_files(copy)[0]
    lines = oldest.read_bytes().split(b"\n")
    header = orjson.loads(lines[0])
    header["schema_version"] = 99
    lines[0] = orjson.dumps(header)
    lines.insert(1, orjson.dumps({"event": "from_the_future", "t": header["t"]}))
    oldest.write_bytes(b"\n".join(lines))
    newest = event_files(copy)[-1]
    newest.write_bytes(newest.read_bytes().rstrip(b"\n")[:-25])   # a cut last line
    cli = _cli(str(copy), capsys=capsys)
    assert "Traceback" not in cli.stderr, cli.stderr
    assert "schema version 99, newer than this tailrace reads (1)" in cli.stderr
    assert "unknown event type 'from_the_future' (1 lines): ignored" in cli.stderr
    assert "its last line is truncated; skipped" in cli.stderr
    assert cli.returncode == 0, cli.stdout


def test_the_timeline_lists_every_request(recorded, capsys):
    log, seen, aborted_id = recorded
    cli = _cli(str(log), "--timeline", capsys=capsys)
    assert cli.returncode == 0, cli.stderr
    rows = [line for line in cli.stdout.splitlines() if not line.startswith(("#", "request "))]
    ids = {line.split()[0] for line in rows}
    assert ids >= {rid for rid, _ in seen.values()} | {aborted_id}
    assert len(rows) == len(seen) + 2                       # and the refused one
    by_id = {line.split()[0]: line for line in rows}
    assert "aborted" in by_id[aborted_id]
    assert "rejected 400" in " ".join(rows)
    assert "/n=2" in by_id[seen["chat_n2_seeded"][0]]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed: `make test` "
                                             "installs it with apt-get, which failed here")
def test_the_page_draws_a_row_per_request_in_a_real_browser(recorded, tmp_path, capsys):
    log, seen, _ = recorded
    page = tmp_path / "timeline.html"
    cli = _cli(str(log), "--html", str(page), capsys=capsys)
    assert cli.returncode == 0, cli.stderr
    source = page.read_text()
    assert "http://" not in source.replace("http://www.w3.org/2000/svg", "")   # no network
    assert "https://" not in source
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--hide-scrollbars", "--window-size=1400,500",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=3000", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120)
    rows = re.findall(r'<div class="row" data-request-id="([^"]+)"', dom.stdout)
    assert len(rows) == len(seen) + 2, dom.stderr[-2000:]   # drawn by the page's script
    assert {rid for rid, _ in seen.values()} <= set(rows)
    assert '<span id="count">%d</span>' % (len(seen) + 2) in dom.stdout
    assert dom.stdout.count('class="seg decode"') >= len(seen)
    shot = tmp_path / "timeline.png"
    subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=3000", f"--screenshot={shot}",
                    page.as_uri()], capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
