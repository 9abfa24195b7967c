"""Tool-call parsers: a model's text -> content and tool calls, incrementally.

A parser is fed the answer text (after any reasoning) piece by piece, as engine steps
produce it, and returns the content it is sure of and the calls it has completed. Every
decision depends only on the text so far, never on where the pieces were cut, so a reply
streamed token by token gets exactly the content and calls of the same reply parsed at
once (tests feed every split).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3,
  Hermes, SmolLM3-style templates); the text before the first call is content.
- `llama3_json`: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`, several separated by `;`), when the answer starts with one.
- `pythonic`: `[f(a=1), g()]` (Llama 3.2/4 and others), when the answer starts with `[`.
- `openai`: gpt-oss's Harmony calls (commentary to=functions.NAME). They are read from the
  token ids by stages/harmony.py, not from text; the name is here so the flag is accepted.

`--tool-parser-plugin PATH` imports a Python file that registers more with
`@register_tool_parser("name")` on a `ToolParser` subclass.

Two internal parsers serve tool_choice "required" and named functions, whose output is
constrained to JSON (a list of {"name", "parameters"} or the function's arguments).
"""
from __future__ import annotations

import abc
import ast
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Callable

import attrs


@attrs.frozen
class ToolCall:
    """A complete call: the function's name and its arguments as a JSON string."""
    name: str
    arguments: str


class ToolParser(abc.ABC):
    """Base: `feed(text, final)` -> (content, calls completed by this text)."""

    def __init__(self) -> None:
        self.buf = ""

    @abc.abstractmethod
    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Take the next piece of text; return the content to pass on and any finished calls."""


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        TOOL_PARSERS[name] = cls
        return cls
    return register


def load_plugin(path: str) -> None:
    """Import a Python file whose @register_tool_parser classes become parser names."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--tool-parser-plugin {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"tailrace_tool_plugin_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def call_id(request_id: str, index: int) -> str:
    """`call_` + 24 hex: deterministic (a replay reproduces every byte), unique per call."""
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


def arguments_text(value: object) -> str:
    """Arguments as OpenAI sends them: a JSON string of an object."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    return json.dumps({} if value is None else value, ensure_ascii=False)


def _call_of(obj: object) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} -> ToolCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return ToolCall(obj["name"], arguments_text(args))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_end(text: str, start: int) -> int:
    """Index just past the JSON value (object or array) opening at text[start], or -1 while
    it is still open: brackets counted outside strings."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


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
                keep = 0 if final else _partial_suffix(self.buf, self.OPEN)
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
                call = _call_of(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
                self.called = True
            else:                     # not a call after all: it was text
                emit(self.OPEN + body + ("" if j < 0 else self.CLOSE))


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    """gpt-oss: calls are Harmony messages, parsed from tokens (stages/harmony.py) by the
    openai_gptoss path of stages/parse.py; a model that is not Harmony has no such calls,
    and its text is content."""

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        return text, []


class _StartsWith(ToolParser):
    """Parsers whose calls, when present, are the whole answer: it is decided at the first
    non-blank character whether the answer is calls or content."""
    STARTS: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.mode = "start"          # start -> content | calls -> done
        self.raw = ""                # everything fed since the start, for a failed parse
        self.emitted = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.raw += text
        if self.mode == "start":
            head = self.raw.lstrip()
            if any(head.startswith(s) for s in self.STARTS):
                self.mode, self.buf = "calls", head
            elif (not head or any(s.startswith(head) for s in self.STARTS)) and not final:
                return "", []        # could still become a call
            else:
                self.mode = "content"
                return self.raw, []
        elif self.mode == "calls":
            self.buf += text
        elif self.mode == "content":
            return text, []
        else:                        # done: text after the calls is dropped
            return "", []
        calls = self.scan(final)     # may set mode to "done" or "failed"
        self.emitted += len(calls)
        if self.mode == "failed" or (final and self.mode == "calls"):
            if self.emitted == 0:    # not calls after all: it was all content
                self.mode = "content"
                return self.raw, []
            self.mode = "done"
        return "", calls

    @abc.abstractmethod
    def scan(self, final: bool) -> list[ToolCall]:
        """Parse the calls found in `self.buf` so far."""


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(_StartsWith):
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
            end = _json_end(s, 0)
            if end < 0:
                self.buf = s
                return calls
            try:
                call = _call_of(json.loads(s[:end]))
            except ValueError:
                call = None
            if call is None:
                self.mode = "failed"
                return calls
            calls.append(call)
            self.buf = s[end:]


@register_tool_parser("pythonic")
class PythonicToolParser(_StartsWith):
    STARTS = ("[", "<|python_start|>")

    def scan(self, final: bool) -> list[ToolCall]:
        s = self.buf.removeprefix("<|python_start|>").lstrip()
        if not s:
            return []
        end = _python_list_end(s)
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


def _python_list_end(text: str) -> int:
    """Index past the Python list opening at text[0], or -1 while open (brackets counted
    outside ' and " strings)."""
    depth, quote, esc = 0, None, False
    for i, c in enumerate(text):
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


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
            end = _json_end(self.buf, start)
            if end < 0:
                break
            try:
                call = _call_of(json.loads(self.buf[start:end]))
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
