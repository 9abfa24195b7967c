"""--api-server-count 2 when a process dies: a frontend's death aborts its requests in
the engine (their blocks freed) and the other frontend keeps serving; the engine's death
ends every open stream with an error event and [DONE], /health answers 503 and the
server exits 1. No process of the server is left in either case."""
from __future__ import annotations

import os
import signal
import time

import httpx

from tests.support.serve_processes import holder, metrics, process_group, server_side_inode, start, wait_for

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}


def test_a_frontend_dies_the_engine_aborts_its_requests_the_other_serves_on(tmp_path):
    server = start(tmp_path, "--api-server-count", "2", "--max-num-seqs", "4",
                   "--api-key", "sekret")
    key = {"Authorization": "Bearer sekret"}
    kids = server.children()
    for _ in range(4):        # every frontend applies the flags: new connections, each 401
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 401
    assert len(kids["engine"]) == 1 and len(kids["frontend"]) == 2
    group = kids["engine"][0]
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{server.url}/v1/completions", json=LONG,
                               headers=key) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                client_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
                victim = holder(kids["frontend"], server_side_inode(port, client_port))
                os.kill(victim, signal.SIGKILL)
                try:
                    for _ in lines:
                        pass
                except httpx.HTTPError:
                    pass             # the connection died with the frontend
        # the other frontend answers everything now, and the engine let go of the request
        wait_for(lambda: (lambda m: m["vllm:num_requests_running"] == 0
                          and m["tailrace:kv_blocks_used"] == 0)(metrics(server.url)),
                 60, "the dead frontend's request to be aborted")
        assert metrics(server.url)["tailrace:engine_steps_total"] < 400   # cut short
        ok = httpx.post(f"{server.url}/v1/completions", timeout=120, headers=key,
                        json={"prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    finally:
        code = server.stop()
    assert code == 1                   # one of its processes died
    assert process_group(group) == []


def test_the_engine_dies_streams_end_with_an_error_and_the_server_exits_1(tmp_path):
    server = start(tmp_path, "--api-server-count", "2", "--max-num-seqs", "4")
    kids = server.children()
    engine = kids["engine"][0]
    try:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{server.url}/v1/completions", json=LONG) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                os.kill(engine, signal.SIGKILL)
                # at once: a frontend answers 503 for STOP_GRACE_S (2 s), then exits
                assert wait_for(lambda: httpx.get(f"{server.url}/health",
                                                  timeout=10).status_code == 503,
                                10, "/health 503")
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "engine" in rest[-2]
        assert server.proc.wait(timeout=60) == 1
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while process_group(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_group(engine) == []
