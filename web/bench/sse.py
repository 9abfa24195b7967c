"""An incremental parser for the WHATWG ``text/event-stream`` format.

The parser works on bytes: only LF, CRLF and CR end a line, and none of those
bytes can occur inside a multi-byte UTF-8 sequence, so a line is split out
before it is decoded. A chunk boundary may therefore fall anywhere, even
inside a character, and characters such as U+2028 or U+0085 stay content.
"""

from __future__ import annotations

import re

import attrs

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
DONE = "[DONE]"


@attrs.frozen
class SSEEvent:
    """One dispatched event; ``event`` is "message" when the stream named none."""

    data: str
    event: str = "message"
    id: str = ""


class SSEParser:
    """Feed bytes in any chunking; get back the events each feed completed.

    Events whose data is empty are dropped, and ``data: [DONE]`` is not
    returned as an event but recorded in ``saw_done``.

    Lines stay bytes until an event is dispatched, and a buffer without CR is
    split with ``bytes.split`` (no regex): this runs once per streamed token in
    ``bench serve``, so it is kept to a few µs (docs/benchmarks.md).
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._skip_lf = False  # the previous chunk ended with CR, so a leading LF is part of that ending
        self._at_start = True
        self._data: list[bytes] = []
        self._event = b""
        self._last_id = ""
        self.saw_done = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._skip_lf and chunk:
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
            self._skip_lf = False
        buf = self._buffer + chunk if self._buffer else bytes(chunk)
        if self._at_start:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._buffer = buf
                return []
            if buf.startswith(_BOM):
                buf = buf[len(_BOM) :]
            self._at_start = False
        if b"\r" in buf:
            lines = _LINE_END.split(buf)
            # A CR at the very end is a whole line ending; the LF that may follow it is skipped.
            if buf.endswith(b"\r"):
                self._skip_lf = True
        else:
            lines = buf.split(b"\n")
        self._buffer = lines.pop()
        events: list[SSEEvent] = []
        for line in lines:
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line[:1] != b":":
                self._other_field(line)
        return events

    def _other_field(self, line: bytes) -> None:
        field, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if field == b"data":  # "data" with no colon: an empty data line
            self._data.append(value)
        elif field == b"event":
            self._event = value
        elif field == b"id" and b"\0" not in value:
            self._last_id = value.decode("utf-8", errors="replace")

    def _dispatch(self) -> SSEEvent | None:
        parts = self._data
        if not parts:
            self._event = b""
            return None
        raw = parts[0] if len(parts) == 1 else b"\n".join(parts)
        self._data = []
        event = self._event.decode("utf-8", errors="replace") if self._event else "message"
        self._event = b""
        if not raw:
            return None
        data = raw.decode("utf-8", errors="replace")
        if data == DONE:
            self.saw_done = True
            return None
        return SSEEvent(data=data, event=event, id=self._last_id)
