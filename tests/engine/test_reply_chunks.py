"""pipeline.core.reply.Reply: what piled up on a reply channel since the reader last ran is
read as one chunk (one socket write per stream per read, not per engine step), with the
same bytes in the same order; the last item's status is kept."""
from __future__ import annotations

import trio

from pipeline.core.reply import Reply
from stages.emit import ReplyEnd


async def test_items_that_piled_up_are_read_as_one_chunk():
    send, receive = trio.open_memory_channel(16)
    reply = Reply(engine=None, request_id="r", stream=True, receive=receive)
    chunks = []
    it = reply.__aiter__()
    send.send_nowait(b"data: 1\n\n")
    chunks.append(await it.__anext__())            # alone: passed on as it is
    for i in (2, 3, 4):                             # three steps while the reader was away
        send.send_nowait(b"data: %d\n\n" % i)
    chunks.append(await it.__anext__())
    send.send_nowait(b"data: [DONE]\n\n")
    send.send_nowait(ReplyEnd(200))
    send.close()
    chunks += [c async for c in it]
    assert chunks == [b"data: 1\n\n", b"data: 2\n\ndata: 3\n\ndata: 4\n\n", b"data: [DONE]\n\n"]
    assert reply.finished and reply.status == 200


async def test_an_end_alone_yields_nothing_and_keeps_its_status():
    send, receive = trio.open_memory_channel(4)
    reply = Reply(engine=None, request_id="r", stream=False, receive=receive)
    send.send_nowait(b'{"a": 1}')
    send.send_nowait(ReplyEnd(400))
    send.close()
    assert await reply.read() == b'{"a": 1}'
    assert reply.status == 400 and reply.finished
