"""--stream-interval N (vLLM's flag): a streaming reply's bytes go to its client every N
tokens instead of every token, which cuts the per-write host cost of serving many
streams (one socket write through Quart, Hypercorn and h11 costs tens of µs, and at 256
streams the writes, not the engine, bound the server).

As in vLLM, a request's first token goes out at once (time to first token is not
delayed), then whatever has been held goes out once N tokens have gathered since the
last send, and everything left goes out with the reply's end. Unlike vLLM, which merges
the held tokens into one SSE event, every event is kept as it would be with N = 1; they
are written together. The event log records the emitted items before they are held, so
a replay is the same whatever N was. Non-streaming replies are one write anyway.
"""
from __future__ import annotations

from stages.emit import ReplyEnd
from stages.messages import Step


class StreamInterval:
    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError("--stream-interval must be at least 1")
        self.interval = interval
        self.streams: dict[str, list] = {}   # request id -> [held bytes, tokens held, sent any]

    def route(self, msg: Step, items: list) -> list:
        """The step's emitted (request id, bytes | ReplyEnd) items, less what is held."""
        if self.interval == 1:
            return items
        streams = self.streams
        for req in msg.new_requests:
            if req.stream:
                streams[req.request_id] = [[], 0, False]
        tokens: dict[str, int] = {}
        for d in msg.deltas:
            if d.token_ids:
                tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.token_ids)
        out = []
        for rid, item in items:
            s = streams.get(rid)
            if s is None:                       # not streaming
                out.append((rid, item))
                continue
            if isinstance(item, ReplyEnd):      # everything held, then the end
                del streams[rid]
                if s[0]:
                    out.append((rid, b"".join(s[0])))
                out.append((rid, item))
                continue
            s[0].append(item)
            s[1] += tokens.pop(rid, 0)
            if not s[2] and s[1] or s[1] >= self.interval:    # the first token, or N of them
                out.append((rid, s[0][0] if len(s[0]) == 1 else b"".join(s[0])))
                s[0], s[1], s[2] = [], 0, True
        return out
