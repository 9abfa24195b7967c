"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3,
Hermes, SmolLM3-style templates); the text before the first call is content. A tagged
format (stages/api/tool_parsers/tagged.py) whose block is one JSON call."""
from __future__ import annotations

import json

from stages.api.tool_parsers.base import ToolCall, call_of, register_tool_parser
from stages.api.tool_parsers.tagged import Tagged


@register_tool_parser("hermes")
class HermesToolParser(Tagged):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def calls_in(self, body: str) -> list[ToolCall]:
        call = call_of(json.loads(body))
        return [] if call is None else [call]
