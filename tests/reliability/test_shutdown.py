"""Graceful shutdown: drain, then end what is left with an in-band error; exit 0.

One real `tailrace serve` process takes real signals (and runs with an API key from the
environment, to check the key never reaches a log); the timeout path runs in this process.
"""
from __future__ import annotations

import signal
import socket
import time

import httpx
import orjson
import trio

from pipeline.core.events import read_events
from tests.support.live_servers import record, served, settled, sse_events, tailrace_serve
from web import server

SECRET = "sk-tailrace-test-6f1d0c0ffee"


def stream_body(max_tokens: int) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}


async def read_stream(http: httpx.AsyncClient, body: dict, started: trio.Event,
                      out: list) -> None:
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        raw = b""
        async for chunk in r.aiter_raw():
            raw += chunk
            if b"data: " in raw:
                started.set()
        out.append((r.headers["x-request-id"], raw))


def assert_ends_with_one_error(raw: bytes, words: str) -> None:
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    errors = [e for e in events[:-1] if b'"error"' in e]
    assert len(errors) == 1 and errors[0] == events[-2], events[-3:]
    assert words in orjson.loads(errors[0])["error"]["message"]


async def wait_for_status(http: httpx.AsyncClient, path: str, status: int) -> httpx.Response:
    with trio.fail_after(10):
        while True:
            r = await http.get(path)
            if r.status_code == status:
                return r
            await trio.sleep(0.02)


async def test_sigterm_drains_then_a_second_signal_aborts_and_the_key_is_never_logged(tmp_path):
    events = tmp_path / "events.jsonl"
    with tailrace_serve(tmp_path, "--max-num-seqs", "4", "--graceful-timeout", "60",
                        "--log-level", "debug", "--enable-log-requests",
                        "--event-log", str(events), env={"TAILRACE_API_KEY": SECRET}) as server:
        auth = {"Authorization": f"Bearer {SECRET}"}
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=60) as http:
            r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                headers={"Authorization": "Bearer sk-wrong-key"})
            assert r.status_code == 401 and "sk-wrong-key" not in r.text
            short_started, long_started = trio.Event(), trio.Event()
            short, long = [], []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_stream, http, stream_body(12), short_started, short)
                nursery.start_soon(read_stream, http, stream_body(110), long_started, long)
                with trio.fail_after(60):
                    await short_started.wait()
                    await long_started.wait()
                server.signal(signal.SIGTERM)
                r = await wait_for_status(http, "/health", 503)
                assert r.headers["retry-after"] == "1"
                refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "server_shutting_down"
                with trio.fail_after(60):
                    while not short:
                        await trio.sleep(0.02)
                assert not long                     # still running: it would take 110 tokens
                server.signal(signal.SIGTERM)       # the second signal ends it
            assert_ends_with_one_error(long[0][1], "shutting down")
        _, short_raw = short[0]
        assert sse_events(short_raw)[-1] == b"[DONE]" and b'"error"' not in short_raw
        assert server.wait(timeout=30) == 0
    logs = server.logs()
    assert "shutting down gracefully" in logs and "ending the requests still in flight" in logs
    assert "Once upon a time" in logs           # --enable-log-requests did log the prompts
    log_events = list(read_events(events))
    last_step = [e for e in log_events if e["event"] == "scheduled"][-1]
    assert last_step["message"]["kv_blocks_used"] == 0
    finishes = {d["request_id"]: d["finish_reason"] for e in log_events
                if e["event"] == "scheduled" for d in e["message"]["deltas"] if d.get("finish_reason")}
    assert finishes[long[0][0]] == "error" and finishes[short[0][0]] == "length"
    for text in (logs, events.read_text()):
        assert SECRET not in text and "sk-wrong-key" not in text
    record("graceful shutdown (SIGTERM, then a second SIGTERM)", sent=3, completed=1,
           refused=1, aborted=1, kv_blocks_used_after=0, exit_code=0)


async def test_the_graceful_timeout_ends_what_is_left(smollm):
    shutdown = trio.Event()
    async with served(smollm, graceful_timeout=1.0, shutdown=shutdown,
                      max_num_seqs=4) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            started, out = [trio.Event(), trio.Event()], []
            async with trio.open_nursery() as nursery:
                for event in started:
                    nursery.start_soon(read_stream, http, stream_body(110), event, out)
                with trio.fail_after(60):
                    for event in started:
                        await event.wait()
                t = time.monotonic()
                shutdown.set()
            waited = time.monotonic() - t
            after = await settled(engine)
    assert waited >= 1.0 and waited < 10    # the timeout, then one step to end them
    for _, raw in out:
        assert_ends_with_one_error(raw, "shutting down")
    assert after["kv_blocks_used"] == 0
    record("graceful timeout (1 s)", sent=2, aborted=2, completed=0, refused=0,
           seconds_to_end=round(waited, 2), kv_blocks_used_after=0)


async def test_clients_that_stopped_reading_cannot_hold_up_the_exit(smollm, caplog):
    """Three clients never read a reply larger than the sockets buffer (40 tokens with 20
    logprobs each, ~140 KB): Hypercorn's writes to them block, shielded from cancellation.
    The server closes those sockets FLUSH_TIMEOUT_S + 1 after it stops instead of hanging."""
    body = orjson.dumps({"prompt": "Write:", "max_tokens": 40, "ignore_eos": True,
                         "stream": True, "logprobs": 20})
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with served(smollm, graceful_timeout=1.0, shutdown=shutdown) as (engine, url):
            host, port = url.removeprefix("http://").split(":")
            clients = []
            for _ in range(3):
                sock = trio.socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                await sock.connect((host, int(port)))
                await sock.send(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: "
                                b"application/json\r\ncontent-length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
                clients.append(sock)
            with trio.fail_after(90):               # generated; the replies wait on the clients
                while engine.stats().generation_tokens_total < 3 * 40:
                    await trio.sleep(0.05)
            await settled(engine)
            shutdown.set()
            start = time.monotonic()
        waited = time.monotonic() - start
    assert server.FLUSH_TIMEOUT_S + 1 <= waited < server.FLUSH_TIMEOUT_S + 5
    assert "connections whose clients stopped reading" in caplog.text
    for sock in clients:
        sock.close()
