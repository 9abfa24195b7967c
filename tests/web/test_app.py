"""web.app and web.server.serve over a fake engine: real HTTP on port 0, no model."""
from __future__ import annotations

import contextlib
import logging
import socket
from functools import partial

import pytest
import trio

import httpx

import pipeline.core.engine
from tests.support.fake_engine import FakeEngine
from web import cli, server
from web.server import listen_socket


async def test_health(served):
    _, http = served
    assert (await http.get("/health")).status_code == 200


async def test_non_streaming_reply_and_request_id(served):
    engine, http = served
    r = await http.post("/v1/chat/completions", json={"messages": []},
                        headers={"x-request-id": "abc-1"})
    assert r.status_code == 200 and r.json() == {"api": "chat", "ok": True}
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-request-id"] == "abc-1"
    assert engine.replies[-1].request_id == "abc-1" and not engine.replies[-1].aborted
    r = await http.post("/v1/completions", json={}, headers={"x-request-id": "bad id!"})
    assert len(r.headers["x-request-id"]) == 32        # replaced by a uuid4 hex
    r = await http.post("/v1/responses", json={"status": 500})
    assert r.status_code == 500                         # reply.status after iteration


async def test_streaming_reply(served):
    engine, http = served
    r = await http.post("/v1/completions", json={"stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.text == 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    with trio.fail_after(2):
        await engine.replies[-1].closed.wait()
    assert not engine.replies[-1].aborted


async def test_disconnect_aborts_the_stream(served):
    engine, http = served
    async with http.stream("POST", "/v1/chat/completions",
                           json={"stream": True, "hang": True}) as r:
        async for _ in r.aiter_bytes():
            break
    reply = engine.replies[-1]
    with trio.fail_after(2):
        await reply.closed.wait()
    assert reply.aborted


async def test_disconnect_aborts_a_non_streaming_request(served):
    engine, http = served
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/v1/completions", json={"hang": True}, timeout=0.3)
    reply = engine.replies[-1]
    with trio.fail_after(2):
        await reply.closed.wait()
    assert reply.aborted


async def test_request_errors_are_openai_json(served):
    _, http = served
    r = await http.post("/v1/chat/completions", json={"model": "x"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `x` does not exist.",
                                  "type": "NotFoundError", "param": "model",
                                  "code": "model_not_found"}}
    r = await http.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await http.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "parse the JSON body" in r.json()["error"]["message"]


async def test_unknown_route_wrong_method_and_crash_are_json(served):
    _, http = served
    r = await http.get("/v2/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Invalid URL (GET /v2/nothing)."
    r = await http.get("/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = await http.post("/v1/chat/completions", json={"boom": True})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "Internal server error: ZeroDivisionError",
                                 "type": "server_error", "param": None, "code": None}


async def test_models_and_metrics(served):
    _, http = served
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["owned_by"] == "tailrace"
    assert models["data"][0]["max_model_len"] == 64
    text = (await http.get("/metrics")).text
    assert 'vllm:num_requests_running{model_name="fake-model"} 0.0' in text
    assert "tailrace:kv_blocks_used 0.0" in text
    assert 'vllm:prompt_tokens_total{model_name="fake-model"} 5.0' in text
    assert 'vllm:request_success_total{finished_reason="stop",model_name="fake-model"} 1.0' in text
    assert 'tailrace:requests_finished_total{finished_reason="abort"} 0.0' in text


def _fake_open_engine(crash_after: float | None = None, opened: list | None = None):
    """Stands in for pipeline.core.engine.open_engine: a FakeEngine whose 'stages' run in the
    context manager's own nursery, and optionally crash."""

    @contextlib.asynccontextmanager
    async def open_engine(config, loaded=None, *, secrets=frozenset()):
        if opened is not None:
            opened.append(config)
        async with trio.open_nursery() as nursery:
            async def stage():
                if crash_after is None:
                    await trio.sleep_forever()
                await trio.sleep(crash_after)
                raise RuntimeError("the GPU caught fire")

            nursery.start_soon(stage)
            yield FakeEngine()
            nursery.cancel_scope.cancel()

    return open_engine


def test_engine_failure_stops_the_server_with_exit_1(monkeypatch, capsys, caplog):
    monkeypatch.setattr(pipeline.core.engine, "open_engine", _fake_open_engine(crash_after=0.3))
    rc = cli.main(["serve", "--port", "0", "--log-level", "critical"])
    assert rc == 1
    assert capsys.readouterr().out.startswith(server.LISTENING_PREFIX)   # it did serve first
    assert "the GPU caught fire" in caplog.text


def test_a_taken_port_fails_before_the_model_loads(monkeypatch, caplog):
    opened: list = []
    monkeypatch.setattr(pipeline.core.engine, "open_engine", _fake_open_engine(opened=opened))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="tailrace"):
            rc = cli.main(["serve", "--port", str(port), "--log-level", "critical"])
    assert rc == 1 and opened == []
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text


def test_a_signal_shuts_down_gracefully(monkeypatch, capsys):
    import os
    import signal
    import threading

    monkeypatch.setattr(pipeline.core.engine, "open_engine", _fake_open_engine())
    # Once the listening line is out, send SIGTERM to ourselves (handled by serve's watcher).
    def print_then_signal(*args, **kwargs):
        print(*args, **kwargs)
        if str(args[0]).startswith(server.LISTENING_PREFIX):
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()

    monkeypatch.setattr(server, "print", print_then_signal, raising=False)
    rc = cli.main(["serve", "--port", "0", "--log-level", "critical"])
    assert rc == 0


async def test_every_route_answers_503_while_the_model_loads(monkeypatch, nursery):
    """serve serves its socket before the model loads: /health and the API answer 503 with
    Retry-After until the engine is up, then 200 (draining and a stopped engine:
    tests/reliability/test_shutdown.py and test_faults.py)."""
    loaded = trio.Event()
    fake = _fake_open_engine()

    @contextlib.asynccontextmanager
    async def slow_open_engine(config, loaded_model=None, *, secrets=frozenset()):
        await loaded.wait()                              # "loading the model"
        async with fake(config) as engine:
            yield engine

    monkeypatch.setattr(pipeline.core.engine, "open_engine", slow_open_engine)
    sock = listen_socket("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    nursery.start_soon(partial(server.serve_model, None, sock, log_level="warning"))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        with trio.fail_after(10):
            while True:
                try:
                    health = await http.get("/health")
                    break
                except httpx.TransportError:          # Hypercorn not up yet
                    await trio.sleep(0.01)
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        assert health.content == b""
        r = await http.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "model_loading"
        assert (await http.get("/v1/models")).status_code == 503
        loaded.set()
        with trio.fail_after(10):
            while (await http.get("/health")).status_code != 200:
                await trio.sleep(0.01)
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "fake-model"
    nursery.cancel_scope.cancel()


async def test_a_reply_sent_before_the_body_keeps_the_connection_alive():
    """The gate answers 503 without reading the request body: the reply still ends only
    after the body has come (web.server.read_body_first), so Hypercorn keeps the
    connection alive for the next request rather than closing it under a keep-alive
    client ("Server disconnected without sending a response")."""
    import h11     # Hypercorn's HTTP/1.1 parser: a client that sees each byte the server sends

    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    async with server.open_http(server.LoadingGate(), sock, log_level="warning"):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = h11.Connection(h11.CLIENT)

        async def exchange(method: bytes, target: bytes, body: bytes = b"", split: int = 0) -> int:
            headers = [(b"host", b"tailrace"), (b"content-length", b"%d" % len(body))]
            await stream.send_all(client.send(h11.Request(method=method, target=target,
                                                          headers=headers)))
            if split:              # the body's end comes after the reply has started
                await stream.send_all(client.send(h11.Data(data=body[:split])))
                await trio.sleep(0.05)
            await stream.send_all(client.send(h11.Data(data=body[split:])))
            await stream.send_all(client.send(h11.EndOfMessage()))
            status = 0
            with trio.fail_after(5):
                while True:
                    event = client.next_event()
                    if event is h11.NEED_DATA:
                        client.receive_data(await stream.receive_some())
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        assert isinstance(event, h11.Data), event   # not ConnectionClosed
            client.start_next_cycle()      # h11: the server said nothing of closing
            return status

        async with stream:
            body = b'{"messages": []}'
            for _ in range(20):   # the whole request at once: the gate races Hypercorn's reader
                assert await exchange(b"POST", b"/v1/chat/completions", body) == 503
            assert await exchange(b"POST", b"/v1/chat/completions", body, split=5) == 503
            for _ in range(3):
                assert await exchange(b"GET", b"/health") == 503
            with trio.move_on_after(0.2):   # and the connection stays open after them
                assert await stream.receive_some() != b""
