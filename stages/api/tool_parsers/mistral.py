"""`mistral`: Mistral's `[TOOL_CALLS]` calls, in both of its forms: a JSON array of
`{"name", "arguments"}` (tokenizers before v11) and, from v11, one
`NAME[ARGS]{...}` (or `NAME[CALL_ID]ID[ARGS]{...}`) after each `[TOOL_CALLS]`. The text
before the first `[TOOL_CALLS]` is content; the calls are read when the answer ends (the
format has no closing tag). With `--tokenizer-mode mistral` the calls' ids are Mistral's
nine alphanumerics (tool_parsers/base.py CALL_IDS)."""
from __future__ import annotations

import json

from stages.api.tool_parsers.base import (ToolCall, ToolParser, arguments_text, call_of,
                                          json_end, partial_suffix, register_tool_parser)

MARK = "[TOOL_CALLS]"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self.calls_text: str | None = None    # everything after the first [TOOL_CALLS]

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.calls_text is not None:
            self.calls_text += text
            return self._end() if final else ("", [])
        self.buf += text
        i = self.buf.find(MARK)
        if i >= 0:
            content, self.calls_text = self.buf[:i], self.buf[i + len(MARK):]
            self.buf = ""
            if not final:
                return content, []
            rest, calls = self._end()
            return content + rest, calls
        keep = 0 if final else partial_suffix(self.buf, MARK)
        content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return content, []

    def _end(self) -> tuple[str, list[ToolCall]]:
        """The calls after the mark; none readable: the text as it came."""
        calls: list[ToolCall] = []
        for piece in self.calls_text.split(MARK):
            try:
                calls += _calls(piece.strip())
            except ValueError:
                pass
        return ("", calls) if calls else (MARK + self.calls_text, [])


def _calls(piece: str) -> list[ToolCall]:
    if not piece:
        return []
    if piece[0] in "[{":                  # the JSON form
        end = json_end(piece, 0)
        value = json.loads(piece if end < 0 else piece[:end])
        items = value if isinstance(value, list) else [value]
        calls = [call_of(item) for item in items]
        if not calls or None in calls:
            raise ValueError("not calls")
        return calls
    if "[ARGS]" not in piece:
        raise ValueError("no [ARGS]")
    name, args = piece.split("[ARGS]", 1)
    name = name.split("[CALL_ID]", 1)[0].strip()
    args = args.strip()
    end = json_end(args, 0) if args[:1] == "{" else -1
    value = json.loads(args if end < 0 else args[:end])
    if not name or not isinstance(value, dict):
        raise ValueError("not a call")
    return [ToolCall(name, arguments_text(value))]
