"""Stateful Responses at the HTTP edge: `store`, `previous_response_id`, `background`, and
GET/DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel.

The pipeline stays stateless: before render, a `previous_response_id` is looked up in the
store (web/responses_store.py) and its conversation (its context, input and output,
reasoning items included) is put in front of the request's `input`; the typed request
only echoes the id. After the reply, its final Response is stored (unless `store` is
false) with the request's own input.

`background: true` runs the request as a stream that no client holds: the POST answers
at once with the response as created (status in_progress); a reader task keeps every
event, so GET .../{id}?stream=true&starting_after=N replays them from a cursor and follows
the rest, GET polls the latest snapshot, and POST .../cancel aborts it (the engine frees
its blocks at the next step) and stores it as `cancelled`. A background response lives in
this process until it ends (a restart loses one still running).
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

import attrs
import orjson
import trio
from quart import Response, request

from stages.api.common import RequestError
from web.responses_store import ResponsesStore, Stored, owner_of

log = logging.getLogger("tailrace.web")

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_SNAPSHOTS = ("response.created", "response.in_progress", *_TERMINAL)


def not_found(response_id: str, param: str | None = None) -> RequestError:
    """OpenAI's 404 for a response that is unknown, evicted or another key's."""
    if param == "previous_response_id":
        return RequestError(f"Previous response with id '{response_id}' not found.",
                            status=404, param=param, code="previous_response_not_found")
    return RequestError(f"Response with id '{response_id}' not found.", status=404,
                        param=param)


def request_key() -> str | None:
    """The API key the request presented (Authorization: Bearer, else x-api-key)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def _input_items(raw: object) -> list[dict]:
    """A request's input as items (a string is one user message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    return [item for item in raw if isinstance(item, dict)] if isinstance(raw, list) else []


def _events(data: bytes) -> list[bytes]:
    return [part + b"\n\n" for part in data.split(b"\n\n") if part]


def _event_data(event: bytes) -> dict:
    return orjson.loads(event[event.index(b"data: ") + 6:])


@attrs.define
class Prepared:
    """A POST /v1/responses after the store has been read."""
    body: dict                 # what render gets
    owner: str
    store: bool
    background: bool
    stream: bool               # as the client asked
    context: list[dict]        # the conversation before this input
    input: list[dict]


class Background:
    """One background response: every event so far and its latest snapshot."""

    def __init__(self, response_id: str, owner: str, prepared: Prepared, reply) -> None:
        self.id = response_id
        self.owner = owner
        self.prepared = prepared
        self.reply = reply
        self.events: list[bytes] = []
        self.snapshot: dict = {}
        self.items: list[dict] = []        # output items done so far
        self.done = trio.Event()
        self.changed = trio.Event()
        self.cancelled = False

    def feed(self, chunk: bytes) -> None:
        for event in _events(chunk):
            self.events.append(event)
            data = _event_data(event)
            kind = data.get("type")
            if kind in _SNAPSHOTS:
                self.snapshot = data["response"]
            elif kind == "response.output_item.done":
                self.items.append(data["item"])
        self.changed.set()
        self.changed = trio.Event()

    def cancel_snapshot(self) -> dict:
        return {**self.snapshot, "status": "cancelled", "output": self.items}

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The events with sequence_number > after, then the rest as they come."""
        sent = max(after + 1, 0)
        while True:
            if sent < len(self.events):
                yield b"".join(self.events[sent:])
                sent = len(self.events)
            if self.done.is_set():
                return
            await self.changed.wait()


class StatefulResponses:
    """The store and the background responses of one app."""

    def __init__(self, store: ResponsesStore, engine, *, keyed: bool,
                 max_background: int = 256) -> None:
        self.store = store
        self.engine = engine                 # an EngineClient: abort() cancels
        self.keyed = keyed                   # with --api-key a response is its key's
        self.background: dict[str, Background] = {}
        self.max_background = max_background

    def owner(self) -> str:
        return owner_of(request_key()) if self.keyed else ""

    async def prepare(self, body: object) -> Prepared | None:
        """Expand previous_response_id; None for a body render will refuse anyway."""
        if not isinstance(body, dict):
            return None
        owner = self.owner()
        store = body.get("store") is not False
        background = body.get("background") is True
        context: list[dict] = []
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            stored = await self.store.get(previous, owner)
            if stored is None:
                raise not_found(previous, "previous_response_id")
            context = stored.conversation()
        own = _input_items(body.get("input"))
        body = dict(body)
        if context and body.get("input") is not None:
            body["input"] = [*context, *own]
        stream = body.get("stream") is True
        if background:
            body["stream"] = True     # its events are kept for GET ...?stream=true
        return Prepared(body, owner, store, background, stream, context, own)

    async def record(self, p: Prepared, response: dict) -> None:
        if p.store and response.get("id"):
            await self.store.put(Stored(id=response["id"], owner=p.owner, response=response,
                                        input=p.input, context=p.context))

    # -- after submit

    async def reply(self, p: Prepared, reply, headers: dict, close) -> Response:
        """The HTTP reply of a submitted request; `close(reply)` aborts it if unfinished."""
        if p.background:
            return await self._start_background(p, reply, headers, close)
        if reply.stream:
            return stream_response(self._recorded_stream(p, reply, close), headers)
        try:
            data = await reply.read()
        finally:
            await close(reply)
        if reply.status == 200:
            await self.record(p, orjson.loads(data))
        return Response(data, status=reply.status, content_type="application/json",
                        headers=headers)

    async def _recorded_stream(self, p: Prepared, reply, close) -> AsyncIterator[bytes]:
        last = b""
        try:
            async for chunk in reply:
                last = chunk
                yield chunk
        finally:
            await close(reply)
        events = _events(last)
        if events and reply.status == 200:
            data = _event_data(events[-1])
            if data.get("type") in _TERMINAL:
                with trio.CancelScope(shield=True):
                    await self.record(p, data["response"])

    async def _start_background(self, p: Prepared, reply, headers: dict, close) -> Response:
        first = b""
        async for chunk in reply:     # response.created, response.in_progress: at admission
            first = chunk
            break
        events = _events(first)
        if not events:
            await close(reply)
            raise RequestError("The background response could not start.", status=500,
                               type="server_error")
        response_id = _event_data(events[0])["response"]["id"]
        bg = Background(response_id, p.owner, p, reply)
        bg.feed(first)
        while len(self.background) >= self.max_background:   # the oldest finished go first
            done = next((k for k, b in self.background.items() if b.done.is_set()), None)
            if done is None:
                break
            del self.background[done]
        self.background[response_id] = bg
        trio.lowlevel.spawn_system_task(self._run_background, bg, close)
        if p.stream:
            return stream_response(bg.follow(-1), headers)
        return _json(bg.snapshot, headers=headers)

    async def _run_background(self, bg: Background, close) -> None:
        try:
            async for chunk in bg.reply:
                bg.feed(chunk)
        except Exception as exc:    # a system task: an error must not escape it
            log.warning("background response %s: %r", bg.id, exc)
        finally:
            with trio.CancelScope(shield=True):
                await close(bg.reply)
                if bg.cancelled or not bg.snapshot.get("status") or \
                        bg.snapshot["status"] == "in_progress":
                    bg.snapshot = bg.cancel_snapshot()
                try:
                    await self.record(bg.prepared, bg.snapshot)
                except Exception as exc:
                    log.warning("background response %s not stored: %r", bg.id, exc)
                bg.done.set()
                bg.changed.set()

    # -- the routes

    async def get(self, response_id: str) -> Response:
        owner = self.owner()
        bg = self.background.get(response_id)
        if bg is not None and bg.owner == owner:
            if request.args.get("stream") == "true":
                try:
                    after = int(request.args.get("starting_after", "-1"))
                except ValueError:
                    raise RequestError("'starting_after' must be an integer.",
                                       param="starting_after") from None
                return stream_response(bg.follow(after), {})
            return _json(bg.snapshot)
        stored = await self.store.get(response_id, owner)
        if stored is None:
            raise not_found(response_id)
        if request.args.get("stream") == "true":
            raise RequestError("Only a background response can be streamed again.",
                               param="stream")
        return _json(stored.response)

    async def delete(self, response_id: str) -> Response:
        owner = self.owner()
        bg = self.background.get(response_id)
        if bg is not None and bg.owner == owner:
            if not bg.done.is_set():
                await self._cancel(bg)
            del self.background[response_id]
        if not await self.store.delete(response_id, owner) and bg is None:
            raise not_found(response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, response_id: str) -> Response:
        owner = self.owner()
        bg = self.background.get(response_id)
        if bg is not None and bg.owner == owner:
            items = bg.prepared.input
        else:
            stored = await self.store.get(response_id, owner)
            if stored is None:
                raise not_found(response_id)
            items = stored.input
        data = [{"id": item.get("id") or f"in_{response_id.removeprefix('resp_')}_{i}", **item}
                for i, item in enumerate(items)]
        if request.args.get("order", "desc") == "desc":   # OpenAI's default order
            data.reverse()
        return _json({"object": "list", "data": data,
                      "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": False})

    async def cancel(self, response_id: str) -> Response:
        owner = self.owner()
        bg = self.background.get(response_id)
        if bg is None or bg.owner != owner:
            if await self.store.get(response_id, owner) is not None:
                raise RequestError("Only a background response can be cancelled.",
                                   param="response_id")
            raise not_found(response_id)
        if not bg.done.is_set():
            await self._cancel(bg)
        return _json(bg.snapshot)

    async def _cancel(self, bg: Background) -> None:
        bg.cancelled = True
        # Abort: the next engine step frees its blocks and the reply ends (the reader sees
        # it end and stores the response as cancelled)
        self.engine.abort(bg.reply.request_id)
        await bg.done.wait()


def _json(value: object, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(value), content_type="application/json", headers=headers or {})


def stream_response(chunks: AsyncIterator[bytes], headers: dict) -> Response:
    response = Response(chunks, status=200, content_type="text/event-stream",
                        headers={**headers, "Cache-Control": "no-cache",
                                 "X-Accel-Buffering": "no"})
    response.timeout = None
    return response
