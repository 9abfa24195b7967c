"""The stored-Responses stores (web/responses_store.py): the LRU bound, owners, and the
SQLite file under concurrent writers, across instances (a restart), lazily opened."""
from __future__ import annotations

import sqlite3

import pytest
import trio

from web.responses_store import MemoryStore, SqliteStore, Stored, owner_of


def _stored(i: int, owner: str = "a") -> Stored:
    return Stored(id=f"resp_{i}", owner=owner,
                  response={"id": f"resp_{i}", "output": [{"type": "message", "n": i}]},
                  input=[{"role": "user", "content": f"q{i}"}], context=[])


@pytest.fixture(params=["memory", "sqlite"])
def make(request, tmp_path):
    def make(bound: int):
        if request.param == "memory":
            return MemoryStore(bound)
        return SqliteStore(tmp_path / "r.sqlite", bound)
    return make


async def test_the_least_recently_used_is_evicted_at_the_bound(make):
    store = make(3)
    for i in range(3):
        await store.put(_stored(i))
    assert (await store.get("resp_0", "a")).input == [{"role": "user", "content": "q0"}]
    await store.put(_stored(3))            # evicts resp_1: resp_0 was just read
    assert await store.get("resp_1", "a") is None
    assert [await store.get(f"resp_{i}", "a") is not None for i in (0, 2, 3)] == [True] * 3
    assert await store.count() == 3


async def test_an_owner_sees_only_its_own(make):
    store = make(10)
    await store.put(_stored(1, owner_of("sk-alice")))
    assert await store.get("resp_1", owner_of("sk-bob")) is None
    assert not await store.delete("resp_1", owner_of("sk-bob"))
    assert await store.get("resp_1", owner_of("sk-alice")) is not None
    assert await store.delete("resp_1", owner_of("sk-alice"))
    assert await store.get("resp_1", owner_of("sk-alice")) is None
    assert owner_of(None) == "" and "sk-alice" not in owner_of("sk-alice")


def test_a_conversation_is_context_input_output():
    s = Stored(id="r", owner="", response={"output": [{"o": 1}]}, input=[{"i": 1}],
               context=[{"c": 1}])
    assert s.conversation() == [{"c": 1}, {"i": 1}, {"o": 1}]


async def test_sqlite_survives_a_new_instance_and_opens_lazily(tmp_path):
    path = tmp_path / "r.sqlite"
    store = SqliteStore(path, 10)
    assert not path.exists()               # nothing opened until first used
    await store.put(_stored(1))
    store.close()
    again = SqliteStore(path, 10)
    got = await again.get("resp_1", "a")
    assert got.response == _stored(1).response and got.context == []


async def test_sqlite_concurrent_writers_stay_within_the_bound(tmp_path):
    path = tmp_path / "r.sqlite"
    stores = [SqliteStore(path, 25), SqliteStore(path, 25)]   # two connections, one file

    async def writer(k: int) -> None:
        for i in range(40):
            await stores[k].put(_stored(k * 1000 + i))

    async with trio.open_nursery() as nursery:
        for k in range(2):
            nursery.start_soon(writer, k)
    rows = sqlite3.connect(path).execute("SELECT COUNT(*) FROM responses").fetchone()[0]
    assert rows == 25
    # the newest of the last writer are there
    assert await stores[0].get("resp_1039", "a") is not None or \
        await stores[0].get("resp_39", "a") is not None
