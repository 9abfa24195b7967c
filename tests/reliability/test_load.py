"""Load on a real server (SmolLM2, the whole pipeline, Hypercorn on 127.0.0.1), bounded in
time: short requests, a small --max-model-len. Each case checks that nothing is left
behind -- no request running or waiting, every KV block free, no reply channel open, no
extra trio task -- and records its figures (docs/reliability.md)."""
from __future__ import annotations

import gc
import random
import socket
import time

import httpx
import orjson
import trio

from pipeline.core.events import read_events
from tests.support.live_servers import (engine_figures, memory_channel_count, record, rss_bytes, served, settled,
                                        sse_events, trio_task_count)

MiB = 1 << 20


def client(url: str, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections))


async def answers(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def tokens_of(body: bytes) -> tuple[int, str | None]:
    """(completion tokens in the final usage chunk, finish_reason) of a completions stream
    asked with include_usage; it must end with [DONE]."""
    events = sse_events(body)
    assert events[-1] == b"[DONE]", body[-200:]
    chunks = [orjson.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return chunks[-1]["usage"]["completion_tokens"], finish[-1]


async def test_disconnect_storm(smollm, tmp_path):
    """200 streams; the client closes a random half after a random number of chunks."""
    events = tmp_path / "events.jsonl"
    rng = random.Random(0)
    closing = {i: rng.randint(1, 3) for i in rng.sample(range(200), 100)}  # i -> chunks read
    closed, completed = set(), set()
    async with served(smollm, max_num_seqs=64, max_queued_requests=256,
                      event_log=str(events)) as (engine, url):
        async with client(url, 210) as http:
            rss0 = rss_bytes()

            async def one(i: int) -> None:
                body = {"prompt": "Tell a story:", "max_tokens": 8, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    rid = r.headers["x-request-id"]
                    if i not in closing:
                        assert tokens_of(await r.aread()) == (8, "length")
                        completed.add(rid)
                        return
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen == closing[i]:
                            break
                    closed.add(rid)         # leaving the block closes the connection

            start = time.monotonic()
            with trio.fail_after(180):
                async with trio.open_nursery() as nursery:
                    for i in range(200):
                        nursery.start_soon(one, i)
            after = await settled(engine)
            await answers(http)
        elapsed = time.monotonic() - start
    finishes = {}
    for e in read_events(events):
        if e["event"] == "scheduled":
            for d in e["message"]["deltas"]:
                if d.get("finish_reason") is not None:   # defaults are left out
                    finishes[d["request_id"]] = d["finish_reason"]
    assert len(closed) == 100 and len(completed) == 100
    assert {rid: finishes.get(rid) for rid in closed} == dict.fromkeys(closed, "abort")
    assert {rid: finishes.get(rid) for rid in completed} == dict.fromkeys(completed, "length")
    assert after == {"running": 0, "waiting": 0, "kv_blocks_used": 0, "in_flight": 0,
                     "admitted": 0}
    record("disconnect storm", sent=200, aborted=len(closed), completed=len(completed),
           refused=0, kv_blocks_used_after=after["kv_blocks_used"], seconds=round(elapsed, 1),
           rss_mib_before=round(rss0 / MiB), rss_mib_after=round(rss_bytes() / MiB))


async def test_overload_is_refused_before_the_stream_starts(smollm):
    """--max-num-seqs 4 --max-queued-requests 8 and 100 concurrent streams: at most 12 are
    admitted at once; the others get 503 + Retry-After and an OpenAI error, never a stream."""
    statuses: list[int] = []
    peak = 0
    async with served(smollm, max_num_seqs=4, max_queued_requests=8) as (engine, url):
        async with client(url, 110) as http:
            await answers(http)
            rss0 = rss_bytes()

            async def one(i: int) -> None:
                body = {"prompt": f"Count to {i}:", "max_tokens": 8, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    raw = await r.aread()
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert r.headers["retry-after"] == "1"
                    assert r.headers["content-type"] == "application/json"
                    assert orjson.loads(raw)["error"]["code"] == "server_overloaded"
                else:
                    assert r.status_code == 200
                    assert tokens_of(raw) == (8, "length") and raw.endswith(b"data: [DONE]\n\n")

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, engine.replies.num_admitted)
                    await trio.sleep(0)

            start = time.monotonic()
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    async with trio.open_nursery() as clients:
                        for i in range(100):
                            clients.start_soon(one, i)
                    nursery.cancel_scope.cancel()
            elapsed = time.monotonic() - start
            after = await settled(engine)
            await answers(http)
            rss1 = rss_bytes()
    refused, ok = statuses.count(503), statuses.count(200)
    assert refused + ok == 100 and refused >= 50 and ok >= 12
    assert peak <= 12
    assert after["kv_blocks_used"] == 0
    assert rss1 - rss0 < 64 * MiB
    record("overload (4 running + 8 queued, 100 concurrent)", sent=100, refused=refused,
           completed=ok, aborted=0, peak_admitted=peak, kv_blocks_used_after=0,
           seconds=round(elapsed, 1), rss_mib_before=round(rss0 / MiB),
           rss_mib_after=round(rss1 / MiB))


async def _slow_reader(url: str, body: bytes, stop: trio.Event, got: list[int]) -> None:
    """A client that reads its stream one byte a second, from a tiny receive buffer."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    async with stream:
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n"
                              b"content-type: application/json\r\ncontent-length: "
                              + str(len(body)).encode() + b"\r\n\r\n" + body)
        while not stop.is_set():
            got.append(len(await stream.receive_some(1)))
            with trio.move_on_after(1):
                await stop.wait()


async def test_slow_readers_cost_neither_time_nor_unbounded_memory(smollm):
    """50 streams read one byte a second. Their generation runs at full speed (the engine
    never waits on a client); once it is done they hold no KV block and no admission slot,
    and the requests of other clients take as long as without them."""
    async with served(smollm, max_num_seqs=64, max_queued_requests=64) as (engine, url):
        async with client(url, 60) as http:
            async def other(i: int) -> None:
                r = await http.post("/v1/completions", json={"prompt": f"Fact {i}:",
                                                             "max_tokens": 8, "ignore_eos": True})
                assert r.json()["usage"]["completion_tokens"] == 8

            async def batch() -> float:
                t = time.monotonic()
                async with trio.open_nursery() as nursery:
                    for i in range(8):
                        nursery.start_soon(other, i)
                return time.monotonic() - t

            # ~3 KB a token (20 logprobs each): far more than the sockets buffer, so the
            # server's writes to these clients block, as they do for a stuck client
            body = orjson.dumps({"prompt": "Write a long poem:", "max_tokens": 16,
                                 "ignore_eos": True, "stream": True, "logprobs": 20})

            async def fast_reader() -> None:
                r = await http.post("/v1/completions", content=body)
                assert r.text.endswith("data: [DONE]\n\n")

            async with trio.open_nursery() as warm:         # the same work, read at once
                for _ in range(50):
                    warm.start_soon(fast_reader)
            await batch()
            alone = await batch()
            tasks0, rss0 = trio_task_count(), rss_bytes()
            stop, got = trio.Event(), []
            with trio.fail_after(120):
                async with trio.open_nursery() as readers:
                    for _ in range(50):
                        readers.start_soon(_slow_reader, url, body, stop, got)
                    await trio.sleep(0.5)
                    generated = await settled(engine, 90)   # every slow stream fully generated
                    tasks_stuck = trio_task_count()
                    with_slow = await batch()
                    rss1 = rss_bytes()
                    stop.set()
            with trio.fail_after(30):                       # their connections wind down
                while trio_task_count() > tasks0:
                    await trio.sleep(0.05)
            await answers(http)
    assert generated["kv_blocks_used"] == 0 and generated["admitted"] == 0
    assert sum(got) >= 50                                   # they did read, slowly
    assert with_slow < 2 * alone + 1.0, (alone, with_slow)
    assert rss1 - rss0 < 64 * MiB
    record("50 slow readers (1 byte/s)", sent=50, completed_in_engine=50, refused=0, aborted=50,
           others_batch_s_alone=round(alone, 2), others_batch_s_with_slow_readers=round(with_slow, 2),
           trio_tasks_before=tasks0, trio_tasks_while_stuck=tasks_stuck,
           kv_blocks_used_while_stuck=generated["kv_blocks_used"],
           rss_mib_before=round(rss0 / MiB), rss_mib_while_stuck=round(rss1 / MiB))


LONG_RUN = 300     # a multiple of 3; a leak of 2 objects a request fails the bound below


async def test_long_run_leaves_nothing_behind(smollm):
    """LONG_RUN short requests (a third not streamed, a third streamed, a third aborted after
    their first chunk), 64 at a time; trio tasks, channels, KV blocks and RSS before and
    after. An idle keep-alive connection opened at the start is closed by the server."""
    async with served(smollm, max_num_seqs=64, max_queued_requests=64) as (engine, url):
        counts = {"completed": 0, "aborted": 0}

        async def one(http: httpx.AsyncClient, i: int) -> None:
            kind = i % 3
            body = {"prompt": "Hi", "max_tokens": 4 if kind == 2 else 1, "ignore_eos": True}
            if kind:
                body.update(stream=True, stream_options={"include_usage": True})
            if kind == 0:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
                counts["completed"] += 1
            else:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    if kind == 1:
                        assert tokens_of(await r.aread()) == (1, "length")
                        counts["completed"] += 1
                    else:
                        async for _ in r.aiter_bytes():
                            break
                        counts["aborted"] += 1

        async def run(n: int) -> None:
            limit = trio.Semaphore(64)

            async def limited(http, i):
                async with limit:
                    await one(http, i)

            async with client(url, 72) as http:
                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(limited, http, i)

        async def quiet() -> tuple[int, int, int, int]:
            await settled(engine)
            with trio.fail_after(10):                 # connection tasks wind down
                while trio_task_count() > base_tasks:
                    await trio.sleep(0.05)
            gc.collect()
            return trio_task_count(), memory_channel_count(), rss_bytes(), len(gc.get_objects())

        base_tasks = trio_task_count()
        with trio.fail_after(60):
            await run(100)                            # warm: allocator, prefix cache, shapes
        tasks0, channels0, rss0, objects0 = await quiet()
        for key in counts:
            counts[key] = 0
        host, port = url.removeprefix("http://").split(":")
        idle = await trio.open_tcp_stream(host, int(port))
        await idle.send_all(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await idle.receive_some()).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        with trio.fail_after(240):
            await run(LONG_RUN)
        elapsed = time.monotonic() - start
        with trio.fail_after(10):                    # Hypercorn's keep-alive timeout is 5 s
            assert await idle.receive_some() == b""  # the server closed the idle connection
        await idle.aclose()
        tasks1, channels1, rss1, objects1 = await quiet()
        figures = engine_figures(engine)
        async with client(url, 2) as http:
            await answers(http)
    assert counts == {"completed": LONG_RUN * 2 // 3, "aborted": LONG_RUN // 3}
    assert figures == {"running": 0, "waiting": 0, "kv_blocks_used": 0, "in_flight": 0,
                       "admitted": 0}
    assert tasks1 == tasks0 and channels1 == channels0
    # A leak of Python objects shows as objects per request; RSS after the requests also
    # carries the allocator's arenas growing under 64-way concurrency (50-140 MiB here
    # whatever the commit, back to 7b67c06: glibc's per-thread arenas), so it only guards against a gross leak.
    print(f"objects {objects0} -> {objects1}, RSS {rss0 / MiB:.0f} -> {rss1 / MiB:.0f} MiB")
    assert objects1 - objects0 < 2 * LONG_RUN, (objects0, objects1)
    assert rss1 - rss0 < 256 * MiB, (rss0, rss1)
    record(f"long run ({LONG_RUN} short requests)", sent=LONG_RUN, completed=counts["completed"],
           aborted=counts["aborted"], refused=0, seconds=round(elapsed, 1),
           trio_tasks_before=tasks0, trio_tasks_after=tasks1, channels_before=channels0,
           channels_after=channels1, kv_blocks_used_after=figures["kv_blocks_used"],
           rss_mib_before=round(rss0 / MiB), rss_mib_after=round(rss1 / MiB))
