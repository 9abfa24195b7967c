"""Stateful Responses with the official openai SDK against a real `tailrace serve`:
previous_response_id, store: false, retrieve/delete/input_items, API-key ownership,
background responses polled, streamed from a cursor and cancelled, 200 concurrent stored
responses against a bound of 50 (no growth past it), and the SQLite store across a
restart."""
from __future__ import annotations

import concurrent.futures
import re
import sqlite3
import time

import httpx
import openai
import pytest

KEYS = ("sk-alice", "sk-bob")
BOUND = 50
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_with_flags):
    serve = serve_with_flags(tmp_path_factory.mktemp("e2e-responses-state"), "--api-key", *KEYS,
                             "--responses-store-max-items", str(BOUND))
    yield next(serve)
    serve.close()


def _client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(server):
    return _client(server)


def _items(response) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_three_turns_by_previous_response_id_equal_the_whole_conversation(alice):
    turns = ["What is the capital of France?", "And of Italy?", "And of Spain?"]
    chained, previous = [], None
    for text in turns:
        r = alice.responses.create(model="", input=text, max_output_tokens=10, **GREEDY,
                                   **({"previous_response_id": previous} if previous else {}))
        assert r.store is True and r.previous_response_id == previous
        chained.append(r)
        previous = r.id
    history: list = []
    for text, r in zip(turns, chained):
        history.append({"role": "user", "content": text})
        whole = alice.responses.create(model="", input=history, max_output_tokens=10,
                                       store=False, **GREEDY)
        assert whole.output_text == r.output_text
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
            r.usage.input_tokens, r.usage.output_tokens)
        history += _items(r)
    # each response's input_items are its own input
    items = alice.responses.input_items.list(chained[2].id)
    assert [i.content for i in items.data] == [turns[2]]


def test_retrieve_returns_the_stored_response_and_delete_removes_it(alice):
    r = alice.responses.create(model="", input="Say hello", max_output_tokens=5, **GREEDY)
    got = alice.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        alice.responses.create(model="", input="x", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"


def test_store_false_leaves_nothing_retrievable(alice):
    r = alice.responses.create(model="", input="Say hello", max_output_tokens=4, store=False,
                               **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.input_items.list(r.id)


def test_a_streamed_response_is_stored_as_it_ended(alice):
    events = list(alice.responses.create(model="", input="Say hello", max_output_tokens=4,
                                         stream=True, **GREEDY))
    final = events[-1].response       # response.incomplete here (max_output_tokens)
    assert events[-1].type == "response.incomplete"
    assert alice.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_another_key_cannot_read_a_stored_response(alice, server):
    bob = _client(server, KEYS[1])
    r = alice.responses.create(model="", input="A secret", max_output_tokens=3, **GREEDY)
    for call in (lambda: bob.responses.retrieve(r.id),
                 lambda: bob.responses.input_items.list(r.id),
                 lambda: bob.responses.delete(r.id),
                 lambda: bob.responses.create(model="", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.retrieve(r.id).id == r.id      # still there for its owner


def _wait(client, response_id, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_a_background_response_is_polled_to_completion(alice):
    r = alice.responses.create(model="", input="Tell me about Paris.", max_output_tokens=12,
                               background=True, **GREEDY)
    assert r.background is True and r.status in ("queued", "in_progress")
    done = _wait(alice, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    same = alice.responses.create(model="", input="Tell me about Paris.",
                                  max_output_tokens=12, store=False, **GREEDY)
    assert done.output_text == same.output_text
    with pytest.raises(openai.BadRequestError):
        alice.responses.create(model="", input="x", background=True, store=False)


def _load(server) -> int:
    return httpx.get(f"{server.url}/load", headers={"authorization": f"Bearer {KEYS[0]}"}
                     ).json()["server_load"]


def test_a_background_response_is_cancelled_mid_generation(alice, server):
    r = alice.responses.create(model="", input="Tell me a very long story.",
                               max_output_tokens=400, background=True, **GREEDY)
    # it runs: events arrive while no client holds it
    with httpx.stream("GET", f"{server.base_url}/responses/{r.id}",
                      params={"stream": "true", "starting_after": "0"},
                      headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=60) as s:
        got = b""
        for chunk in s.iter_bytes():
            got += chunk
            if got.count(b"response.output_text.delta") >= 3:
                break
    assert b'"sequence_number":0,' not in got      # from after the cursor
    cancelled = alice.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert alice.responses.retrieve(r.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while _load(server) and time.monotonic() < deadline:   # its slot and blocks are freed
        time.sleep(0.1)
    assert _load(server) == 0
    metrics = httpx.get(f"{server.url}/metrics").text
    assert re.search(r'^vllm:kv_cache_usage_perc\{[^}]*\} 0\.0$', metrics, re.M), metrics
    assert re.search(r'^vllm:num_requests_running\{[^}]*\} 0\.0$', metrics, re.M)


def test_a_background_stream_replays_from_its_cursor(alice, server):
    stream = alice.responses.create(model="", input="Say hi.", max_output_tokens=6,
                                    background=True, stream=True, **GREEDY)
    events = list(stream)
    rid = events[0].response.id
    assert events[-1].type in ("response.completed", "response.incomplete")
    again = alice.responses.retrieve(rid, stream=True, starting_after=2)
    replayed = list(again)
    assert [e.sequence_number for e in replayed] == [e.sequence_number for e in events[3:]]
    assert replayed[-1].response.output_text == events[-1].response.output_text


def test_200_concurrent_stored_responses_stay_within_the_bound(alice, server):
    patient = alice.with_options(timeout=600)     # 200 at once on a shared 2-core box

    def one(i: int) -> str:
        return patient.responses.create(model="", input=f"Count to {i}.", max_output_tokens=2,
                                      **GREEDY).id

    rss = None
    for _ in range(2):   # the first round fills the store (and warms the engine's buffers)
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            ids = list(pool.map(one, range(200)))
        rss = rss or _rss_kib(server)
    kept = 0
    for rid in ids:
        try:
            alice.responses.retrieve(rid)
            kept += 1
        except openai.NotFoundError:
            pass
    assert kept == BOUND
    grown = _rss_kib(server) - rss     # 200 more stored, 200 more evicted: no growth
    assert grown < 32 * 1024, f"RSS grew {grown} KiB"


def _rss_kib(server) -> int:
    status = open(f"/proc/{server.proc.pid}/status").read()
    return int(next(l for l in status.splitlines() if l.startswith("VmRSS:")).split()[1])


def test_the_sqlite_store_survives_a_restart(tmp_path, serve_with_flags):
    db = tmp_path / "responses.sqlite"
    flags = ("--responses-store", str(db), "--responses-store-max-items", "5")
    (tmp_path / "a").mkdir()
    serve = serve_with_flags(tmp_path / "a", *flags)
    server = next(serve)
    try:
        c = _client(server)
        first = c.responses.create(model="", input="What is the capital of France?",
                                   max_output_tokens=8, **GREEDY)
        evicted = [c.responses.create(model="", input=f"n {i}", max_output_tokens=1,
                                      **GREEDY).id for i in range(3)]
        c.responses.retrieve(first.id)            # touched: the LRU keeps it
        for _ in range(2):                        # 6 > 5: the least recently used goes
            last = c.responses.create(model="", input="x", max_output_tokens=1, **GREEDY)
    finally:
        serve.close()
    rows = sqlite3.connect(db).execute("SELECT COUNT(*) FROM responses").fetchone()[0]
    assert rows == 5
    (tmp_path / "b").mkdir()
    serve = serve_with_flags(tmp_path / "b", *flags)
    server = next(serve)
    try:
        c = _client(server)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        assert c.responses.retrieve(last.id).id == last.id
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(evicted[0])
        follow = c.responses.create(model="", input="And of Italy?", max_output_tokens=8,
                                    previous_response_id=first.id, **GREEDY)
        assert follow.output_text
    finally:
        serve.close()
