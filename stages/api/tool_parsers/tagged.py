"""Parsers whose calls are blocks between an opening and a closing tag, after any content:
Qwen3-Coder's and Qwen3.5's XML (`qwen3_coder`, `qwen3_xml`), GLM-4.5's (`glm45`), Kimi
K2's (`kimi_k2`), DeepSeek V3's and V3.1's (`deepseek_v3`, `deepseek_v31`) and MiniMax
M2's (`minimax_m2`), under vLLM's names. Formats read from vLLM's parsers' documented
outputs; the code is this project's own.

As `hermes` (a Tagged parser too): the text before the first block is content; a block's calls are complete at
its closing tag (or at the end of the answer, for a block left open); after the first
call, text outside blocks is dropped; a block that holds no call is passed on as text.
Every decision depends only on the text so far, so any split gives the same result.

The XML formats carry parameter values as text. A value that reads as JSON (a number,
true, false, null, an object or an array) is that JSON value, any other is a string: the
parser does not see the tools' schemas (vLLM's use them to type a value).
"""
from __future__ import annotations

import json
import re

from stages.api.tool_parsers.base import (ToolCall, ToolParser, arguments_text, json_end,
                                          partial_suffix, register_tool_parser)


class Tagged(ToolParser):
    """Blocks between OPEN and CLOSE, each parsed by `calls_in` into calls."""
    OPEN: str = ""
    CLOSE: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.in_block = False
        self.called = False

    def calls_in(self, body: str) -> list[ToolCall]:
        raise NotImplementedError

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content: list[str] = []
        calls: list[ToolCall] = []

        def emit(piece: str) -> None:
            if not self.called:
                content.append(piece)

        while True:
            if not self.in_block:
                i = self.buf.find(self.OPEN)
                if i >= 0:
                    emit(self.buf[:i])
                    self.buf = self.buf[i + len(self.OPEN):]
                    self.in_block = True
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
            self.in_block = False
            try:
                found = self.calls_in(body)
            except ValueError:
                found = []
            if found:
                calls += found
                self.called = True
            else:
                emit(self.OPEN + body + ("" if j < 0 else self.CLOSE))


def xml_value(text: str) -> object:
    """A parameter's text: JSON when it reads as a JSON value other than a string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _json_arguments(text: str) -> str:
    """A call's JSON arguments (an object), text after the object dropped."""
    text = text.strip()
    if not text:
        return "{}"
    end = json_end(text, 0) if text[0] in "{[" else -1
    value = json.loads(text if end < 0 else text[:end])
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    return arguments_text(value)


def _call(name: str, arguments: dict | str) -> ToolCall:
    name = name.strip()
    if not name:
        raise ValueError("a call without a name")
    if isinstance(arguments, str):
        return ToolCall(name, arguments)
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


@register_tool_parser("qwen3_coder")
@register_tool_parser("qwen3_xml")
class Qwen3XmlToolParser(Tagged):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`;
    a value's first and last newline belong to the markup."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def calls_in(self, body: str) -> list[ToolCall]:
        out = []
        for name, inner in _FUNCTION.findall(body):
            args = {key.strip(): xml_value(_trim_newline(value))
                    for key, value in _PARAMETER.findall(inner)}
            out.append(_call(name, args))
        return out


def _trim_newline(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@register_tool_parser("glm45")
class Glm45ToolParser(Tagged):
    """GLM-4.5/4.6/4.7: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>
    ...</tool_call>`."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def calls_in(self, body: str) -> list[ToolCall]:
        name = body.split("<arg_key>", 1)[0]
        if "\n" in name.strip() or "{" in name:
            raise ValueError("not a GLM call")
        args = {k.strip(): xml_value(v) for k, v in _GLM_ARG.findall(body)}
        return [_call(name, args)]


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>"
                        r"(.*?)(?:<\|tool_call_end\|>|\Z)", re.S)


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(Tagged):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`."""
    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    def calls_in(self, body: str) -> list[ToolCall]:
        out = []
        for ident, args in _KIMI_CALL.findall(body):
            name = ident.rsplit(":", 1)[0].removeprefix("functions.")
            out.append(_call(name, _json_arguments(args)))
        return out


_DS_OPEN, _DS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_V3_CALL = re.compile(r"<｜tool▁call▁begin｜>[^<]*?<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n"
                         r"(.*?)\n```\s*(?:<｜tool▁call▁end｜>|\Z)", re.S)
_DS_V31_CALL = re.compile(r"<｜tool▁call▁begin｜>([^<]+?)<｜tool▁sep｜>(.*?)"
                          r"(?:<｜tool▁call▁end｜>|\Z)", re.S)


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(Tagged):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}
    \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""
    OPEN, CLOSE = _DS_OPEN, _DS_CLOSE
    CALL = _DS_V3_CALL

    def calls_in(self, body: str) -> list[ToolCall]:
        return [_call(name, _json_arguments(args)) for name, args in self.CALL.findall(body)]


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""
    CALL = _DS_V31_CALL


_INVOKE = re.compile(r'<invoke name="?([^">]+)"?>(.*?)(?:</invoke>|\Z)', re.S)
_MINIMAX_PARAM = re.compile(r'<parameter name="?([^">]+)"?>(.*?)</parameter>', re.S)


@register_tool_parser("minimax_m2")
class MiniMaxM2ToolParser(Tagged):
    """`<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>...
    </invoke>...</minimax:tool_call>`."""
    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"

    def calls_in(self, body: str) -> list[ToolCall]:
        out = []
        for name, inner in _INVOKE.findall(body):
            args = {k.strip(): xml_value(v.strip()) for k, v in _MINIMAX_PARAM.findall(inner)}
            out.append(_call(name, args))
        return out
