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
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skip_lf = False  # the previous chunk ended with CR, so a leading LF is part of that ending
        self._at_start = True
        self._data: list[str] = []
        self._event = ""
        self._last_id = ""
        self.saw_done = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._skip_lf and chunk:
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
            self._skip_lf = False
        self._buffer += chunk
        if self._at_start:
            if len(self._buffer) < len(_BOM) and _BOM.startswith(bytes(self._buffer)):
                return []
            if self._buffer.startswith(_BOM):
                del self._buffer[: len(_BOM)]
            self._at_start = False
        events: list[SSEEvent] = []
        pos = 0
        for match in _LINE_END.finditer(self._buffer):
            line = bytes(self._buffer[pos : match.start()])
            pos = match.end()
            event = self._process_line(line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        if pos and pos == len(self._buffer) and self._buffer[-1:] == b"\r":
            self._skip_lf = True
        del self._buffer[:pos]
        return events

    def _process_line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._last_id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        data = "\n".join(self._data)
        event = self._event or "message"
        self._data.clear()
        self._event = ""
        if not data:
            return None
        if data == DONE:
            self.saw_done = True
            return None
        return SSEEvent(data=data, event=event, id=self._last_id)
