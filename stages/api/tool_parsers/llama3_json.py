"""`llama3_json`: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`, several separated by `;`), when the answer starts with one."""
from __future__ import annotations

import json

from stages.api.tool_parsers.base import StartsWith, ToolCall, call_of, json_end, register_tool_parser


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(StartsWith):
    STARTS = ("<|python_tag|>", "{")

    def scan(self, final: bool) -> list[ToolCall]:
        calls = []
        while True:
            s = self.buf.lstrip().removeprefix("<|python_tag|>").lstrip()
            if s.startswith(";"):
                s = s[1:].lstrip()
            if not s:
                self.buf = ""
                return calls
            if s[0] != "{":
                self.mode = "failed"
                return calls
            end = json_end(s, 0)
            if end < 0:
                self.buf = s
                return calls
            try:
                call = call_of(json.loads(s[:end]))
            except ValueError:
                call = None
            if call is None:
                self.mode = "failed"
                return calls
            calls.append(call)
            self.buf = s[end:]
