"""Where stored Responses live (`store: true`, OpenAI's default): a bounded store with LRU
eviction, in memory (the default) or in an SQLite file (`--responses-store PATH`).

A stored response is its final Response JSON, the input items its request sent, and the
conversation before them (what `previous_response_id` had put in front), so that a
continuation is that conversation + this input + this output. Each belongs to an owner (a
digest of the API key that made it, "" when the server needs no key): another owner's
response is not found, exactly as one that never existed.

Both stores keep at most `max_items` responses: storing one more evicts the least recently
used (stored or read). The SQLite store opens its file on first use and reads rows only
when asked (nothing is loaded at start-up); every call runs in a worker thread, one at a
time per process, each write one transaction; WAL journaling and a busy timeout let
several processes (`--api-server-count`) share one file.
"""
from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import attrs
import orjson
import trio

DEFAULT_MAX_ITEMS = 1024


def owner_of(key: str | None) -> str:
    """The owner an API key stands for (its digest: the key itself is never kept)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


@attrs.frozen
class Stored:
    id: str
    owner: str
    response: dict             # the final Response, as the client got it
    input: list[dict]          # the request's own input items
    context: list[dict]        # the conversation before them (previous responses)
    created: float = attrs.field(factory=time.time)

    def conversation(self) -> list[dict]:
        """What a response continuing this one has before its own input."""
        return [*self.context, *self.input, *self.response.get("output", ())]


class ResponsesStore(Protocol):
    max_items: int

    async def put(self, stored: Stored) -> None: ...

    async def get(self, response_id: str, owner: str) -> Stored | None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    async def count(self) -> int: ...


class MemoryStore:
    """In this process's memory: an OrderedDict in LRU order, at most max_items."""

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, Stored] = OrderedDict()

    async def put(self, stored: Stored) -> None:
        self._items[stored.id] = stored
        self._items.move_to_end(stored.id)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    async def get(self, response_id: str, owner: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._items.move_to_end(response_id)
        return stored

    async def delete(self, response_id: str, owner: str) -> bool:
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            return False
        del self._items[response_id]
        return True

    async def count(self) -> int:
        return len(self._items)


_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, used INTEGER NOT NULL,
    response BLOB NOT NULL, input BLOB NOT NULL, context BLOB NOT NULL)"""
_USED_INDEX = "CREATE INDEX IF NOT EXISTS responses_used ON responses (used)"


class SqliteStore:
    """An SQLite file that survives restarts; the same bound and LRU order (a `used`
    counter, bumped by every put and get)."""

    def __init__(self, path: str | Path, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.path = Path(path)
        self.max_items = max_items
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()            # one connection, one call at a time
        self._limiter = trio.CapacityLimiter(1)

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.path, timeout=10, check_same_thread=False,
                                   isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SCHEMA)
            conn.execute(_USED_INDEX)
            self._conn = conn
        return self._conn

    async def _run(self, fn, *args):
        def call():
            with self._lock:
                return fn(self._connect(), *args)
        return await trio.to_thread.run_sync(call, limiter=self._limiter)

    @staticmethod
    def _next_used(conn: sqlite3.Connection) -> int:
        return conn.execute("SELECT COALESCE(MAX(used), 0) + 1 FROM responses").fetchone()[0]

    def _put(self, conn: sqlite3.Connection, s: Stored) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (s.id, s.owner, s.created, self._next_used(conn),
                          orjson.dumps(s.response), orjson.dumps(s.input),
                          orjson.dumps(s.context)))
            (n,) = conn.execute("SELECT COUNT(*) FROM responses").fetchone()
            if n > self.max_items:
                conn.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                             "ORDER BY used LIMIT ?)", (n - self.max_items,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _get(self, conn: sqlite3.Connection, response_id: str, owner: str) -> Stored | None:
        row = conn.execute("SELECT id, owner, created, response, input, context FROM responses "
                           "WHERE id = ? AND owner = ?", (response_id, owner)).fetchone()
        if row is None:
            return None
        conn.execute("UPDATE responses SET used = ? WHERE id = ?",
                     (self._next_used(conn), response_id))
        return Stored(id=row[0], owner=row[1], created=row[2], response=orjson.loads(row[3]),
                      input=orjson.loads(row[4]), context=orjson.loads(row[5]))

    @staticmethod
    def _delete(conn: sqlite3.Connection, response_id: str, owner: str) -> bool:
        cur = conn.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                           (response_id, owner))
        return cur.rowcount > 0

    @staticmethod
    def _count(conn: sqlite3.Connection) -> int:
        return conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    async def put(self, stored: Stored) -> None:
        await self._run(self._put, stored)

    async def get(self, response_id: str, owner: str) -> Stored | None:
        return await self._run(self._get, response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._run(self._delete, response_id, owner)

    async def count(self) -> int:
        return await self._run(self._count)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def open_store(path: str | None, max_items: int = DEFAULT_MAX_ITEMS) -> ResponsesStore:
    return MemoryStore(max_items) if path is None else SqliteStore(path, max_items)
