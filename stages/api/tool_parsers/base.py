"""What every tool-call parser shares: the `ToolCall` it yields, the `ToolParser` contract
and registry, the base of parsers whose calls are the whole answer, and the text helpers
(also used by stages/parse.py's reasoning parser)."""
from __future__ import annotations

import abc
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


_ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id(request_id: str, index: int) -> str:
    """A Mistral tokenizer's tool-call id (--tokenizer-mode mistral): 9 alphanumerics, the
    only form mistral-common accepts back in a conversation (vLLM's MistralToolCall ids);
    deterministic like call_id."""
    n = int.from_bytes(hashlib.sha256(f"{request_id}/{index}".encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALPHANUMERIC))
        out.append(_ALPHANUMERIC[r])
    return "".join(out)


CALL_IDS = {"openai": call_id, "mistral": mistral_call_id}   # by Tokenizer.tool_call_ids


def arguments_text(value: object) -> str:
    """Arguments as OpenAI sends them: a JSON string of an object."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    return json.dumps({} if value is None else value, ensure_ascii=False)


def call_of(obj: object) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} -> ToolCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return ToolCall(obj["name"], arguments_text(args))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def bracket_end(text: str, start: int, quotes: str, opens: str, closes: str) -> int:
    """Index just past the bracketed value opening at text[start], or -1 while it is still
    open: brackets (any of `opens` / `closes`) counted outside strings, which open and
    close with the same one of `quotes` and take backslash escapes."""
    depth, quote, esc = 0, "", False
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = ""
        elif c in quotes:
            quote = c
        elif c in opens:
            depth += 1
        elif c in closes:
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def json_end(text: str, start: int) -> int:
    """Index just past the JSON value (object or array) opening at text[start], or -1 while
    it is still open."""
    return bracket_end(text, start, '"', "{[", "}]")


class StartsWith(ToolParser):
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
