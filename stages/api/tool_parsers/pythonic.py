"""`pythonic` and `llama4_pythonic`: `[f(a=1), g()]` (Llama 3.2/4 and others), when the
answer starts with `[` (or Llama 4's `<|python_start|>`; its `<|python_end|>` and anything
after the list are dropped)."""
from __future__ import annotations

import ast
import json

from stages.api.tool_parsers.base import StartsWith, ToolCall, bracket_end, register_tool_parser


@register_tool_parser("pythonic")
@register_tool_parser("llama4_pythonic")   # Llama 4's: the list inside <|python_start|>...
class PythonicToolParser(StartsWith):
    STARTS = ("[", "<|python_start|>")

    def scan(self, final: bool) -> list[ToolCall]:
        s = self.buf.removeprefix("<|python_start|>").lstrip()
        if not s:
            return []
        end = bracket_end(s, 0, "'\"", "([{", ")]}")   # the Python list at s[0]
        if end < 0:
            if final:
                self.mode = "failed"
            return []
        self.mode = "done"
        try:
            return _pythonic_calls(s[:end])
        except (SyntaxError, ValueError):
            self.mode = "failed"
            return []


def _pythonic_calls(source: str) -> list[ToolCall]:
    tree = ast.parse(source, mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
            raise ValueError("not a call")
        name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
        if node.args:
            raise ValueError("positional arguments")
        args = {}
        for kw in node.keywords:
            value = kw.value
            if isinstance(value, ast.Name) and value.id in ("true", "false", "null"):
                args[kw.arg] = {"true": True, "false": False, "null": None}[value.id]
            else:
                args[kw.arg] = ast.literal_eval(value)
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls
