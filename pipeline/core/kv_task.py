"""The KV connector's task in the engine core (issue 36), beside schedule: the prefill
side's side channel (stages/lib/kv_transfer.py `serve_side_channel`: the cache's NIXL
layout for a decode side, and frees from a decode side that refused a request) and the
watch on NIXL's notifications (a decode side's read has landed). Either way the held
blocks are freed by a `KVRelease` in schedule's inbox, as every change to the scheduler
arrives; while requests are held it also sends one with `expire` every EXPIRE_TICK_S,
for vLLM's abort timeout."""
from __future__ import annotations

import logging

import trio

from stages.lib.kv_transfer import serve_side_channel
from stages.messages import KVRelease

log = logging.getLogger("tailrace.kv")

POLL_S = 0.02          # NIXL's notifications are looked at this often
EXPIRE_TICK_S = 0.25


async def run(connector, inbox: trio.MemorySendChannel, scheduler) -> None:
    """`scheduler` is only read (its held count), never changed: that is the inbox's."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(connector.sock))
    frees: list[str] = []

    def free(request_id: str) -> None:
        frees.append(request_id)

    async with inbox, trio.open_nursery() as nursery:
        nursery.start_soon(serve_side_channel, listener, connector.layout, free)
        since_expire = 0.0
        while True:
            await trio.sleep(POLL_S)
            since_expire += POLL_S
            ids = connector.released() + tuple(frees)
            frees.clear()
            expire = bool(scheduler.held) and since_expire >= EXPIRE_TICK_S
            if expire:
                since_expire = 0.0
            if ids or expire:
                await inbox.send(KVRelease(ids, expire))
