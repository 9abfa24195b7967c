"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3,
Hermes, SmolLM3-style templates); the text before the first call is content."""
from __future__ import annotations

import json

from stages.api.tool_parsers.base import (ToolCall, ToolParser, call_of, partial_suffix,
                                      register_tool_parser)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.in_call = False
        self.called = False          # after the first call, text outside calls is dropped

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, calls = [], []

        def emit(piece: str) -> None:
            if not self.called:       # after the first call, text outside calls is dropped
                content.append(piece)

        while True:
            if not self.in_call:
                i = self.buf.find(self.OPEN)
                if i >= 0:
                    emit(self.buf[:i])
                    self.buf = self.buf[i + len(self.OPEN):]
                    self.in_call = True
                    continue
                keep = 0 if final else partial_suffix(self.buf, self.OPEN)
                emit(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return "".join(content), calls
            j = self.buf.find(self.CLOSE)
            if j < 0 and not final:
                return "".join(content), calls
            body = self.buf if j < 0 else self.buf[:j]
            self.buf = "" if j < 0 else self.buf[j + len(self.CLOSE):]
            self.in_call = False
            try:
                call = call_of(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
                self.called = True
            else:                     # not a call after all: it was text
                emit(self.OPEN + body + ("" if j < 0 else self.CLOSE))
