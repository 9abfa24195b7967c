"""Harmony (gpt-oss): chat messages -> Harmony messages -> prompt tokens, and the model's
tokens -> reasoning, content and tool calls.

Rendering builds openai-harmony `Message`s and lets the library render the tokens:

| request | Harmony messages, in order |
|---|---|
| a user message | system; user |
| leading system (or developer) text | system; developer (instructions); user |
| tools (tool_choice not "none") | system; developer (instructions, if any, and the tools); user |

- system carries the reasoning effort (`reasoning_effort`, default medium) and the date;
- an assistant message: `reasoning` -> analysis; `content` -> final, or commentary (a
  preamble) when it comes with tool calls; each call -> commentary to=functions.NAME with
  the JSON arguments; reasoning with empty content is the analysis message alone;
- a tool message -> commentary authored by functions.NAME (the name of the call its
  tool_call_id answers), to the assistant;
- a later system/developer message -> a developer message with those instructions.
Every earlier analysis message is rendered (no dropping of past reasoning).

Parsing feeds each sampled token to openai-harmony's `StreamableParser`: analysis text is
reasoning, final text and commentary without a recipient are content, and a message to
functions.X becomes tool call X once its <|call|> (or <|end|>) closes it. Token by token,
so any split of the tokens into steps gives the same result; control tokens never reach
the text (the parser's content deltas hold message text only).
"""
from __future__ import annotations

import datetime
import json
from typing import Any

import attrs

from gpu.tokenizers.harmony import harmony_encoding, uses_harmony
from stages.api.chat import Arguments
from stages.api.common import RequestError
from stages.api.tool_parsers import ToolCall
from stages.messages import ToolPlan

__all__ = ["HARMONY_REASONING_PARSER", "HARMONY_TOOL_PARSER", "HarmonyState", "render_ids",
           "uses_harmony"]

HARMONY_REASONING_PARSER = "openai_gptoss"
HARMONY_TOOL_PARSER = "openai"
_EFFORTS = {"low": "LOW", "medium": "MEDIUM", "high": "HIGH"}   # ReasoningEffort's members
_FUNCTIONS = "functions."
_CALL_TYPE = "<|constrain|>json"


def _oh():
    """openai-harmony, imported when a Harmony model first needs it: every other model
    family (and the GPU image, which lacks the package) never imports it."""
    import openai_harmony
    return openai_harmony


def _text(value: Any) -> str:
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)


def _effort(value: Any) -> ReasoningEffort:
    if value is None:
        return _oh().ReasoningEffort.MEDIUM
    if value not in _EFFORTS:
        # "minimal" and "none" exist in OpenAI's API; gpt-oss knows low, medium, high.
        raise RequestError(f"'reasoning_effort' must be one of low, medium, high for this "
                           f"model, got {value!r}.", param="reasoning_effort")
    return _oh().ReasoningEffort[_EFFORTS[value]]


def _tool_descriptions(tools: list[dict]) -> list[ToolDescription]:
    out = []
    for tool in tools:
        fn = tool["function"]
        out.append(_oh().ToolDescription.new(fn["name"], fn.get("description") or "",
                                       parameters=fn.get("parameters")))
    return out


def harmony_messages(messages: list[dict], tools: list[dict] | None = None,
                     reasoning_effort: str | None = None,
                     today: datetime.date | None = None) -> list[Message]:
    """Template-form chat messages (stages/api/chat.template_messages: developer is
    already "system", tool call arguments objects) -> Harmony messages."""
    system = (_oh().SystemContent.new().with_reasoning_effort(_effort(reasoning_effort))
              .with_conversation_start_date((today or datetime.date.today()).isoformat()))
    out = [_oh().Message.from_role_and_content(_oh().Role.SYSTEM, system)]
    start = 0
    instructions = []
    while start < len(messages) and messages[start]["role"] == "system":
        instructions.append(_text(messages[start]["content"]))
        start += 1
    if instructions or tools:
        dev = _oh().DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools(_tool_descriptions(tools))
        out.append(_oh().Message.from_role_and_content(_oh().Role.DEVELOPER, dev))
    call_names: dict[str, str] = {}       # tool_call_id -> function name
    unanswered: list[str] = []            # the ids (or names) of calls with no result yet
    for i in range(start, len(messages)):
        m = messages[i]
        role, content = m["role"], _text(m.get("content"))
        if role == "system":
            out.append(_oh().Message.from_role_and_content(
                _oh().Role.DEVELOPER, _oh().DeveloperContent.new().with_instructions(content)))
        elif role == "user":
            out.append(_oh().Message.from_role_and_content(_oh().Role.USER, content))
        elif role == "assistant":
            out += _assistant(m, content, call_names, unanswered)
        elif role == "tool":
            # as vLLM's Harmony path: a result's text parts joined with nothing between
            parts = getattr(m.get("content"), "parts", ())
            out.append(_tool_result(m, "".join(parts) if parts else content, call_names,
                                    unanswered))
    return out


def _tool_result(m: dict, content: str, call_names: dict[str, str],
                 unanswered: list[str]) -> Message:
    """A tool result is authored by the function it answers: the call its tool_call_id
    names, else its own `name`, else (neither, as clients may send, and vLLM accepts) the
    earliest call not answered yet; with no call at all, an unnamed function (vLLM's
    `functions.`)."""
    call_id = m.get("tool_call_id")
    if call_id in call_names:
        name = call_names[call_id]
        key = call_id
    elif m.get("name"):
        name = m["name"]
        key = next((k for k in unanswered if call_names.get(k, k) == name), name)
    elif unanswered:
        key = unanswered[0]
        name = call_names.get(key, key)
    else:
        name = key = ""
    if key in unanswered:
        unanswered.remove(key)
    return (_oh().Message.from_author_and_content(
        _oh().Author.new(_oh().Role.TOOL, _FUNCTIONS + name), content)
        .with_channel("commentary").with_recipient("assistant"))


def _assistant(m: dict, content: str, call_names: dict[str, str],
               unanswered: list[str]) -> list[Message]:
    out = []
    reasoning = m.get("reasoning")
    if reasoning:
        out.append(_oh().Message.from_role_and_content(_oh().Role.ASSISTANT, reasoning)
                   .with_channel("analysis"))
    calls = m.get("tool_calls") or []
    if content:
        out.append(_oh().Message.from_role_and_content(_oh().Role.ASSISTANT, content)
                   .with_channel("commentary" if calls else "final"))
    for call in calls:
        fn = call.get("function") or {}
        name = fn.get("name") or ""
        if call.get("id"):
            call_names[call["id"]] = name
        unanswered.append(call.get("id") or name)
        args = fn.get("arguments")
        if not isinstance(args, str):        # the text the model wrote, when there was one
            args = (args.raw if isinstance(args, Arguments) else "") or json.dumps(
                {} if args is None else args, ensure_ascii=False)
        out.append(_oh().Message.from_role_and_content(_oh().Role.ASSISTANT, args)
                   .with_channel("commentary").with_recipient(_FUNCTIONS + name)
                   .with_content_type(_CALL_TYPE))
    return out


def render_ids(messages: list[dict], template_kwargs: dict, *,
               add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids: the conversation rendered by openai-harmony, ending in
    `<|start|>assistant` for the model to continue."""
    enc = harmony_encoding()
    conv = _oh().Conversation.from_messages(harmony_messages(
        messages, template_kwargs.get("tools"), template_kwargs.get("reasoning_effort")))
    config = _oh().RenderConversationConfig(auto_drop_analysis=False)
    if add_generation_prompt:
        return enc.render_conversation_for_completion(conv, _oh().Role.ASSISTANT, config)
    return enc.render_conversation(conv, config)


# -- parsing -------------------------------------------------------------------------------

@attrs.frozen
class Parsed:
    """What one feed produced: text per field and the calls that completed."""
    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    reasoning_tokens: int = 0   # the tokens fed that are analysis text
    reasoning_span: int = 0     # how many of them, from the first, are no answer's text


class HarmonyState:
    """One choice's Harmony output: a StreamableParser fed token by token.

    With `tools` (an "auto" plan) a message to functions.X is a tool call; without, its
    text is content. A stream that stops being Harmony (a model that wrote something
    else) keeps its text as content from there on, and an answer that never opened a
    message (plain text, no control token) is content when it ends: nothing is lost and
    nothing raises.
    """

    def __init__(self, tools: ToolPlan | None = None) -> None:
        self.enc = harmony_encoding()
        self.parser = _oh().StreamableParser(self.enc, _oh().Role.ASSISTANT, strict=False)
        self.tools = tools is not None
        self.ends = frozenset(self.enc.encode(t, allowed_special="all")[0]
                              for t in ("<|end|>", "<|call|>", "<|return|>"))
        self.channel: str | None = None
        self.recipient: str | None = None
        self.args: list[str] = []             # the open call's arguments so far
        self.broken: list[int] | None = None  # not Harmony any more: tokens not yet text
        self.started = False                  # a message's content has begun
        self.header: list[int] = []           # the tokens before that

    def feed(self, token_ids: tuple[int, ...] | list[int], final: bool = False) -> Parsed:
        content, reasoning, calls = [], [], []
        counted, span, leading = 0, 0, True
        for tok in token_ids:
            if self.broken is not None:
                self._raw(tok, content)
                leading = False
                continue
            try:
                self.parser.process(tok)
            except Exception:                # HarmonyError: not a Harmony stream after all
                self.broken = []
                self._raw(tok, content)
                leading = False
                continue
            channel, recipient = self.parser.current_channel, self.parser.current_recipient
            if channel is not None:
                self.channel, self.recipient = channel, recipient
                self.started = True
            elif not self.started:
                self.header.append(tok)
            delta = self.parser.last_content_delta
            # per token, so a delta of several counts right: an analysis message's text
            # tokens are reasoning (a character cut across tokens: each of its tokens)
            analysis = (channel == "analysis" and not self._is_call()
                        and not self.enc.is_special_token(tok))
            counted += analysis
            # the span: the leading tokens that are no answer's or call's (analysis text,
            # its <|message|> and <|end|>, the headers)
            special = self.enc.is_special_token(tok)
            if leading and (analysis or (self.channel == "analysis" and special) or (
                    self.parser.state != _oh().StreamState.CONTENT and tok not in self.ends)):
                span += 1
            else:
                leading = False
            if delta:
                if self._is_call():
                    self.args.append(delta)
                elif self.channel == "analysis":
                    reasoning.append(delta)
                else:                        # final; commentary to no function (a preamble)
                    content.append(delta)
            if tok in self.ends:
                if self._is_call():
                    calls.append(ToolCall(self.recipient[len(_FUNCTIONS):],
                                          "".join(self.args).strip() or "{}"))
                self.channel = self.recipient = None
                self.args = []
        if final and self.broken:
            content.append(self.enc.decode(self.broken))   # a cut character: U+FFFD
            self.broken.clear()
        if final and not self.started and not any(map(self.enc.is_special_token, self.header)):
            # no header ever opened a message: the model wrote plain text, not Harmony
            content.append(self.enc.decode(self.header))
        return Parsed("".join(content), "".join(reasoning), tuple(calls), counted, span)

    def _is_call(self) -> bool:
        return (self.tools and self.recipient is not None
                and self.recipient.startswith(_FUNCTIONS))

    def _raw(self, tok: int, content: list[str]) -> None:
        if self.enc.is_special_token(tok):
            return
        self.broken.append(tok)
        try:
            content.append(self.enc.decode_utf8(self.broken))
            self.broken.clear()
        except Exception:                     # a character split across tokens: wait
            pass
