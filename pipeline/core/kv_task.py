"""The KV connector's task in the engine core (issue 36), beside schedule: the prefill
side's side channel (gpu/kv_transfer/side_channel.py has its messages; `serve_side_channel`: the cache's NIXL
layout for a decode side, and frees from a decode side that refused a request) and the
watch on NIXL's notifications (a decode side's read has landed). Either way the held
blocks are freed by a `KVRelease` in schedule's inbox, as every change to the scheduler
arrives; while requests are held it also sends one with `expire` every EXPIRE_TICK_S,
for vLLM's abort timeout."""
from __future__ import annotations

import json
import logging

import trio

from gpu.kv_transfer.side_channel import SIDE_CHANNEL_TIMEOUT_S
from stages.messages import KVRelease

log = logging.getLogger("tailrace.kv")

POLL_S = 0.02          # NIXL's notifications are looked at this often
EXPIRE_TICK_S = 0.25


async def serve_side_channel(listener, layouts, free, no_rank: bytes = b"") -> None:
    """The prefill side's listener (a trio SocketListener): answer each connection's one
    JSON line; `layouts[R]` to a layout asked for TP rank R (`no_rank` for a rank past
    them), `free(request_id)` for a free (it puts the message in schedule's inbox)."""
    async def one(stream) -> None:
        async with stream:
            data = b""
            with trio.move_on_after(SIDE_CHANNEL_TIMEOUT_S):
                while not data.endswith(b"\n") and len(data) < 1 << 16:
                    got = await stream.receive_some(1 << 16)
                    if not got:
                        break
                    data += got
            try:
                msg = json.loads(data)
                op = msg.get("op")
            except (ValueError, AttributeError):
                op = None
            if op == "layout":
                rank = msg.get("rank", 0)
                ok = type(rank) is int and 0 <= rank < len(layouts)
                answer = layouts[rank] if ok else (no_rank or b'{"error": "no such rank"}\n')
            elif op == "free" and isinstance(msg.get("request_id"), str):
                free(msg["request_id"])
                answer = b'{"ok": true}\n'
            else:
                answer = b'{"error": "unknown op"}\n'
            try:
                await stream.send_all(answer)
            except trio.BrokenResourceError:
                pass

    await trio.serve_listeners(one, [listener])


async def run(connector, inbox: trio.MemorySendChannel, scheduler) -> None:
    """`scheduler` is only read (its held count), never changed: that is the inbox's."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(connector.sock))
    frees: list[str] = []

    def free(request_id: str) -> None:
        frees.append(request_id)

    async with inbox, trio.open_nursery() as nursery:
        nursery.start_soon(serve_side_channel, listener, connector.layouts, free,
                           connector.no_rank)
        since_expire = 0.0
        while True:
            await trio.sleep(POLL_S)
            since_expire += POLL_S
            ids = connector.released() + tuple(frees)
            frees.clear()
            expire = bool(scheduler.kv.held) and since_expire >= EXPIRE_TICK_S
            if expire:
                since_expire = 0.0
            if ids or expire:
                await inbox.send(KVRelease(ids, expire))
