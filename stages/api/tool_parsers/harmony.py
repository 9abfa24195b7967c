"""`openai`: gpt-oss's Harmony calls, read from the token ids by stages/api/harmony.py; the
name is registered here so that the flag is accepted."""
from __future__ import annotations

from stages.api.tool_parsers.base import ToolCall, ToolParser, register_tool_parser


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    """gpt-oss: calls are Harmony messages, parsed from tokens (stages/api/harmony.py) by the
    openai_gptoss path of stages/parse.py; a model that is not Harmony has no such calls,
    and its text is content."""

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        return text, []
