"""The two internal parsers of constrained tool calls: tool_choice naming a function (the
output is its arguments) and tool_choice "required" (a JSON array of calls)."""
from __future__ import annotations

import json

from stages.api.tool_parsers.base import ToolCall, ToolParser, arguments_text, call_of, json_end


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the whole output is its arguments (constrained to
    the function's parameter schema)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buf += text
        if not final:
            return "", []
        try:
            json.loads(self.buf)
        except ValueError:
            # cut by max tokens before the arguments closed: an incomplete call is not a
            # call (as vLLM: no tool_calls, finish_reason "length"); the text is all there is
            return self.buf, []
        return "", [ToolCall(self.name, arguments_text(self.buf))]


class RequiredToolParser(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"}; each
    call is emitted as soon as its object closes (so max_tokens cutting a long array still
    leaves the calls before the cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0                 # where the next item may start
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buf += text
        calls = []
        while True:
            start = self.buf.find("{", self.pos)
            if start < 0:
                break
            end = json_end(self.buf, start)
            if end < 0:
                break
            try:
                call = call_of(json.loads(self.buf[start:end]))
            except ValueError:
                call = None
            if call is None:
                break
            calls.append(call)
            self.pos = end
        self.num_calls += len(calls)
        if final and not self.num_calls:
            return self.buf, []      # no complete call: the text is all there is
        return "", calls
