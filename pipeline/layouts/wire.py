"""The wire between the engine process and a frontend process (--api-server-count).

One `socketpair` per frontend, read and written with trio's own socket API. A frame is
a 4-byte length, a kind byte and the payload:

- ``STEP``: one engine step's deltas for the sequences one frontend owns, as packed
  columns (request ids, token ids, choice index, first-scheduled time, cached tokens; the
  rare finish, stop reason, error and logprobs as sparse rows) in one `marshal` blob:
  a step of 256 decoding sequences is one frame and a few tuples, not 256 objects
  (`pack_step` / `unpack_step`; scripts/bench_wire.py measures it).
- ``OBJ``: any other message (a request, an admission answer, an abort, stats), pickled:
  a few per request, not per token.

Both ends are this same interpreter and code, started by this server, so marshal's and
pickle's formats match and nothing untrusted is ever decoded.

`Link` frames and sends and receives them. The message types that only cross the wire
(a refusal, the frontend's setup, stats queries) live here; the rest are the stages' own
(stages/messages.py, stages/admit.py)."""
from __future__ import annotations

import marshal
import math
import pickle
import struct

import attrs
import trio

from pipeline.core.assembly import RequestSideSpec
from stages.delta import Delta, FinishReason
from stages.messages import Step
from gpu.interface import TokenLogprobs

STEP, OBJ = 1, 2
_HEADER = struct.Struct("<IB")
_RECV = 1 << 20



# -- messages that only cross the wire -------------------------------------------------------
@attrs.frozen
class Refused:
    """admit refused a request (engine -> its frontend): the RequestError's fields, since
    an exception with keyword arguments does not pickle by itself."""
    request_id: str
    message: str
    status: int
    type: str
    param: str | None = None
    code: str | None = None


@attrs.frozen
class StatsQuery:
    """A frontend is scraped (/metrics): the engine's stats, summed over every frontend."""
    query: int


@attrs.frozen
class StatsReply:
    query: int
    stats: object           # pipeline.core.stats.EngineStats


@attrs.frozen
class AccountQuery:
    """The engine asks every frontend for its accountant's counters (for a StatsQuery)."""
    query: int


@attrs.frozen
class AccountReply:
    query: int
    totals: object          # pipeline.core.stats.AccountStats


@attrs.frozen
class Load:
    """An engine's load (data parallel), sent to every frontend when it changes: what a
    frontend picks the engine of a new request by (vLLM's DP coordinator's counts)."""
    rank: int
    waiting: int
    running: int
    kv_usage: float         # KV blocks held / all


@attrs.frozen
class ControlQuery:
    """A frontend's POST /reset_prefix_cache, /sleep or /wake_up (frontend -> each engine):
    a stages.messages.Control in the engine core's inbox, answered by a ControlReply."""
    query: int
    op: str
    level: int = 1
    reset_running: bool = False


@attrs.frozen
class ControlReply:
    query: int
    value: object           # the Control's answer: reset or not, or None / an error string


@attrs.frozen
class SleepState:
    """An engine's sleep state ("awake", "falling", "asleep"), sent to every frontend when a
    sleep or a wake-up changes it: every frontend refuses new requests unless all its
    engines are awake, whichever frontend asked."""
    rank: int
    state: str


@attrs.frozen
class Drain:
    """Take no new request (the server is shutting down)."""


# -- Step frames ------------------------------------------------------------------------------
def _lp(x: TokenLogprobs | None):
    return None if x is None else (x.logprob, x.top_ids, x.top_logprobs, x.rank)


def _unlp(x) -> TokenLogprobs | None:
    return None if x is None else TokenLogprobs(*x)


def pack_step(step: Step, new_ids: list[str], items: list[tuple[str, Delta]]) -> bytes:
    """A frame for one frontend: `step`'s header, the ids of the requests it admitted
    since the last step (the frontend holds those requests already), and its deltas, each
    under the frontend's own request id."""
    rids, toks, index, sched, cached, extras = [], [], [], [], [], []
    for i, (rid, d) in enumerate(items):
        rids.append(rid)
        toks.append(d.token_ids)
        index.append(d.index)
        sched.append(d.scheduled_at)
        cached.append(d.num_cached_tokens)
        if (d.finish_reason is not None or d.token_logprobs or d.prompt_token_logprobs
                or d.error is not None or d.draft_tokens):
            # kv_transfer_params: a prefill instance's finishing delta (issue 36), a dict
            # of str, int, bool and a list of ints, which marshal takes as it is
            extras.append((i, None if d.finish_reason is None else d.finish_reason.value,
                           d.stop_reason, d.error, tuple(map(_lp, d.token_logprobs)),
                           tuple(map(_lp, d.prompt_token_logprobs)), d.draft_tokens,
                           d.accepted_tokens, d.kv_transfer_params))
    payload = marshal.dumps((step.step, step.num_running, step.num_waiting, step.kv_blocks_used,
                             step.done_at, tuple(new_ids), tuple(rids), tuple(toks), tuple(index),
                             tuple(sched), tuple(cached), tuple(extras)))
    return _HEADER.pack(len(payload) + 1, STEP) + payload


def unpack_step(payload: bytes | memoryview, requests: dict, engine: int = 0) -> Step:
    """A Step frame back into a Step (of data-parallel rank `engine`); `requests` maps the
    new requests' ids to the RenderedRequests this frontend sent (popped here: each is new
    once)."""
    (number, running, waiting, kv_used, done_at, new_ids, rids, toks, index, sched, cached,
     extras) = marshal.loads(payload)
    # every row as a running sequence's tokens (most rows of most steps), positional in
    # field order (by keyword: a dict per call, +50% to unpack): request_id, token_ids,
    # finish_reason, stop_reason, num_cached_tokens, error, token_logprobs, scheduled_at,
    # index; then the rare rows built again whole
    deltas = [Delta(rid, tok, None, None, c, None, (), s, i)
              for rid, tok, i, s, c in zip(rids, toks, index, sched, cached)]
    for k, reason, stop, error, lps, plps, drafted, accepted, kv_params in extras:
        d = deltas[k]
        deltas[k] = Delta(d.request_id, d.token_ids,
                          None if reason is None else FinishReason(reason), stop,
                          d.num_cached_tokens, error, tuple(map(_unlp, lps)), d.scheduled_at,
                          d.index, tuple(map(_unlp, plps)),
                          drafted, accepted,   # speculative decoding's per-request figures
                          kv_transfer_params=kv_params)
    new = tuple(requests.pop(rid) for rid in new_ids)
    return Step(number, new, tuple(deltas), running, waiting, kv_used, done_at, engine)


def pack(msg: object) -> bytes:
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload) + 1, OBJ) + payload


# -- the link -----------------------------------------------------------------------------
class Link:
    """One end of a socketpair: `send` a message or a packed frame, `receive` the next
    (kind, payload) frame; EndOfChannel when the other process has gone."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self._lock = trio.StrictFIFOLock()
        self._first: list[bytes] = []   # frames that go before the next one sent (send_first)
        self._buf = bytearray()
        self._pos = 0
        self.closed = False

    async def send(self, msg: object) -> None:
        await self.send_frame(pack(msg))

    def send_first(self, msg: object) -> None:
        """Queue `msg` to go, without waiting, ahead of whatever frame is sent next by
        anyone (`send_frame`): an engine's Accepted must reach its frontend before a Step
        frame that carries the request's first tokens, and those two are written by two
        tasks. The caller then nudges a `forward` (its outbox gets NUDGE), which sends it
        if no other frame goes first."""
        self._first.append(pack(msg))

    async def send_frame(self, frame: bytes) -> None:
        """BrokenResourceError when the other end has gone."""
        async with self._lock:
            if self._first:     # taken under the lock: they precede this frame on the wire
                frame = b"".join((*self._first, frame))
                self._first.clear()
            if not frame:
                return
            view = memoryview(frame)
            try:
                while view:
                    sent = await self.sock.send(view)
                    view = view[sent:]
            except OSError as exc:
                self.closed = True
                raise trio.BrokenResourceError(str(exc)) from exc

    async def receive_frame(self) -> tuple[int, memoryview]:
        buf = self._buf
        while True:
            have = len(buf) - self._pos
            if have >= _HEADER.size:
                size, kind = _HEADER.unpack_from(buf, self._pos)
                if have >= 4 + size:
                    start = self._pos + _HEADER.size
                    payload = bytes(buf[start:self._pos + 4 + size])
                    self._pos += 4 + size
                    if self._pos > _RECV:             # drop what was read, now and then
                        del buf[:self._pos]
                        self._pos = 0
                    return kind, payload
            try:
                data = await self.sock.recv(_RECV)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                raise trio.EndOfChannel
            buf += data

    async def receive(self) -> object:
        kind, payload = await self.receive_frame()
        if kind != OBJ:
            raise ValueError(f"expected a message, got a frame of kind {kind}")
        return pickle.loads(payload)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


NUDGE = object()    # in an outbox: send what Link.send_first queued (nothing of its own)


async def forward(receive: trio.MemoryReceiveChannel, link: Link) -> None:
    """Send what arrives on a memory channel over `link`, everything waiting in one write:
    the back-edges (aborts, stop strings) are sent without waiting (send_nowait) by
    stages that must not block, into an unbounded channel that this drains. Once the
    other end has gone it keeps draining, sending nothing, so those senders never fail."""
    async with receive:
        async for msg in receive:
            frames = [] if msg is NUDGE else [pack(msg)]
            while True:
                try:
                    msg = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                if msg is not NUDGE:
                    frames.append(pack(msg))
            if link.closed:
                continue
            try:
                await link.send_frame(b"".join(frames))
            except trio.BrokenResourceError:
                pass      # the reader of this link sees it close and acts


def outbox() -> tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]:
    """The channel `forward` drains. Unbounded: what goes in is bounded by the requests
    in flight (one abort, one stop per choice), and a sender must never wait on it."""
    return trio.open_memory_channel(math.inf)


@attrs.frozen
class FrontendSetup:
    """What the engine process hands each frontend once the model has loaded: its request
    side (pipeline.core.assembly.RequestSideSpec: the render context with the tokenizer,
    the parsers), the flags a frontend applies (web.app.AppConfig: API keys, CORS, limits)
    and the event log's."""
    index: int
    side: RequestSideSpec | None      # None until the engine has loaded the model
    app_config: object                # web.app.AppConfig
    graceful_timeout: float
    event_log: str | None = None      # this frontend's file (the engine's path + .frontend-K)
    event_log_header: dict | None = None
    event_log_max_bytes: int = 0
    event_log_backup_count: int = 5
    sleep_mode: bool = False          # --enable-sleep-mode: the frontend serves /sleep...
