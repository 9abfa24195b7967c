"""The Responses API's reply: the Response object, and its event stream.

Stream order: response.created, response.in_progress; per output item (reasoning
first, when the model reasons, then the message): output_item.added,
reasoning_part/content_part.added, *_text.delta..., *_text.done,
reasoning_part/content_part.done, output_item.done; then one terminal event:
response.completed, response.incomplete (max_output_tokens) or error + response.failed.
A call is one item: function_call_arguments.delta/done, or for a custom tool
custom_tool_call_input.delta/done (a custom_tool_call item carrying its free-text input).

What a Response repeats of its request (instructions, tools, metadata...) comes from the
request's ResponseEcho (stages/api/responses.py `reply_spec`), not the typed request.
"""
from __future__ import annotations

import json
from typing import Any

import attrs
import orjson

from stages.api.common import ABSENT, omit_absent, reply, unstructure
from stages.api.framing import Framer, ResponseUsage, error_bytes, json_body, response_usage
from stages.api.tools import CUSTOM_INPUT
from stages.delta import Delta, FinishReason
from stages.messages import ResponseEcho


@reply
class OutputText:
    type: str = "output_text"
    text: str
    annotations: list[Any] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)


@reply
class TopLogprobOut:
    token: str
    bytes: list[int]
    logprob: float


@reply
class OutputLogprob:
    """A token of output_text with its logprob and alternatives (OpenAI's Logprob)."""
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprobOut]


@reply
class DeltaTopLogprob:
    token: str
    logprob: float


@reply
class DeltaLogprob:
    """A token of an output_text.delta event (OpenAI's delta shape: no bytes)."""
    token: str
    logprob: float
    top_logprobs: list[DeltaTopLogprob]


def output_logprobs(entries) -> list[OutputLogprob]:
    return [OutputLogprob(token=e.token, bytes=list(e.token.encode()), logprob=e.logprob,
                          top_logprobs=[TopLogprobOut(token=t, bytes=list(t.encode()), logprob=v)
                                        for t, v in e.top]) for e in entries]


def delta_logprobs_of(logprobs: list[OutputLogprob]) -> list[DeltaLogprob]:
    """output_text.done's logprobs: the text's, in the delta shape."""
    return [DeltaLogprob(token=e.token, logprob=e.logprob,
                         top_logprobs=[DeltaTopLogprob(token=t.token, logprob=t.logprob)
                                       for t in e.top_logprobs]) for e in logprobs]


def delta_logprobs(entries) -> list[DeltaLogprob]:
    return [DeltaLogprob(token=e.token, logprob=e.logprob,
                         top_logprobs=[DeltaTopLogprob(token=t, logprob=v) for t, v in e.top])
            for e in entries]


@reply
class ReasoningText:
    type: str = "reasoning_text"
    text: str


@reply
class MessageItem:
    id: str
    type: str = "message"
    status: str
    role: str = "assistant"
    content: list[OutputText]


@reply
class ReasoningItem:
    id: str
    type: str = "reasoning"
    summary: list[Any] = attrs.field(factory=list)
    content: list[ReasoningText]
    status: str


@reply
class FunctionCallItem:
    arguments: str
    call_id: str
    name: str
    type: str = "function_call"
    id: str
    status: str


@reply
class CustomToolCallItem:
    """A call of a custom tool: its free-text input (the function's one string argument,
    stages/api/tools.py CUSTOM_PARAMETERS)."""
    call_id: str
    input: str
    name: str
    type: str = "custom_tool_call"
    id: str
    status: str


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the parser found ({"input": TEXT})."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
    text = value.get(CUSTOM_INPUT) if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


@reply
class ResponseError:
    code: str = "server_error"
    message: str


@reply
class IncompleteDetails:
    reason: str


@reply
class TextFormatOut:
    type: str = "text"


@reply
class TextOut:
    format: TextFormatOut = TextFormatOut()


@reply
class ReasoningOut:
    effort: str | None = None
    summary: str | None = None


@reply
class RawMessage:
    """vLLM's ResponseRawMessageAndToken: a text and its token ids (the ids win where the
    two differ)."""
    message: str
    tokens: list[int]
    type: str = "raw_message_tokens"


@omit_absent
@reply
class Response:
    id: str
    object: str = "response"
    created_at: int
    status: str                      # in_progress | completed | incomplete | failed
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[MessageItem | ReasoningItem | FunctionCallItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOut = ReasoningOut()
    store: bool = True
    temperature: float = 1.0
    text: TextOut = TextOut()
    tool_choice: Any = "auto"
    tools: list[Any] = attrs.field(factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    # enable_response_messages: the rendered prompt, and the model's output, with their ids
    input_messages: list[RawMessage] | Any = ABSENT
    output_messages: list[RawMessage] | Any = ABSENT


_CALL_KINDS = ("function_call", "custom_tool_call")

# -- the reply -----------------------------------------------------------------------------

class _OutputItem:
    """One output item of a Response while it is being built."""

    def __init__(self, kind: str, item_id: str, output_index: int, call=None) -> None:
        self.kind = kind    # "reasoning" | "message" | "function_call" | "custom_tool_call"
        self.call = call                  # function_call: the ToolCallDelta
        self.id = item_id
        self.output_index = output_index
        self.parts: list[str] = []
        self.logprobs: list[OutputLogprob] = []   # message: its text's, when included
        self.status = "in_progress"       # -> "completed" | "incomplete"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def part(self, text: str, logprobs: list | None = None) -> OutputText | ReasoningText:
        if self.kind == "reasoning":
            return ReasoningText(text=text)
        return OutputText(text=text, logprobs=logprobs or [])

    def reply(self, *, with_content: bool = True) -> (MessageItem | ReasoningItem
                                                      | FunctionCallItem | CustomToolCallItem):
        if self.kind == "custom_tool_call":
            return CustomToolCallItem(
                call_id=self.call.id, name=self.call.name, id=self.id, status=self.status,
                input=custom_input(self.call.arguments) if with_content else "")
        if self.kind == "function_call":
            return FunctionCallItem(arguments=self.call.arguments if with_content else "",
                                    call_id=self.call.id, name=self.call.name, id=self.id,
                                    status=self.status)
        content = [self.part(self.text, self.logprobs)] if with_content else []
        if self.kind == "reasoning":
            return ReasoningItem(id=self.id, content=content, status=self.status)
        return MessageItem(id=self.id, status=self.status, content=content)


class ResponsesFramer(Framer):
    def __init__(self, req) -> None:
        super().__init__(req)
        self.id = f"resp_{req.request_id}"
        self._seq = 0
        self._items: list[_OutputItem] = []
        # include message.output_text.logprobs: the logprobs of the tokens of the answer
        # (a step's tokens count as the answer's when the step brought answer text)
        self._wants_logprobs = req.sampling.options.logprobs is not None
        self._held: list = []
        # what the Response repeats of its request (a request without one repeats the defaults)
        self._echo = req.reply.response or ResponseEcho()
        # enable_response_messages: the model's whole output (its text before parsing)
        self._raw_text: list[str] | None = None if self._echo.prompt_text is None else []
        self._raw_ids: list[int] = []

    # -- state shared by both modes

    def _item(self, kind: str) -> tuple[_OutputItem, bool]:
        """The open item of this kind, creating it (closing the one before) if needed."""
        if self._items and self._items[-1].kind == kind and self._items[-1].status == "in_progress":
            return self._items[-1], False
        prefix = "rs_" if kind == "reasoning" else "msg_"
        item = _OutputItem(kind, f"{prefix}{self.req.request_id}", len(self._items))
        self._items.append(item)
        return item, True

    def _takes_reasoning(self) -> bool:
        # Reasoning after the answer has started cannot be shown in order; the
        # <think> parsers never produce it.
        return not any(item.kind != "reasoning" for item in self._items)

    def _calls(self) -> bool:
        return any(item.kind in _CALL_KINDS for item in self._items)

    def _add_call(self, call) -> _OutputItem:
        custom = any(t.get("type") == "custom" and t.get("name") == call.name
                     for t in self._echo.tools if isinstance(t, dict))
        kind = "custom_tool_call" if custom else "function_call"
        prefix = "ctc_" if custom else "fc_"
        item = _OutputItem(kind, prefix + call.id.removeprefix("call_"), len(self._items), call)
        self._items.append(item)
        return item

    def _note(self, delta: Delta) -> None:
        if self._raw_text is not None:
            self._raw_text.append(delta.text)
            self._raw_ids += delta.token_ids

    def _messages(self, done: bool) -> dict[str, Any]:
        """input_messages and output_messages (vLLM's raw form), on a finished Response
        that asked for them."""
        if self._raw_text is None or not done:
            return {}
        r = self._echo
        output = "".join(self._raw_text)
        return {"input_messages": [RawMessage(message=r.prompt_text,
                                              tokens=list(r.prompt_token_ids))],
                "output_messages": ([RawMessage(message=output, tokens=list(self._raw_ids))]
                                    if output or self._raw_ids else [])}

    def _response(self, status: str, *, usage=None, incomplete_reason: str | None = None,
                  error: str | None = None) -> Response:
        r = self._echo
        options = self.req.sampling.options
        return Response(**self._messages(status in ("completed", "incomplete")),
            id=self.id, created_at=self.req.created, status=status, model=self.req.model,
            output=[item.reply() for item in self._items],
            error=None if error is None else ResponseError(message=error),
            incomplete_details=(None if incomplete_reason is None
                                else IncompleteDetails(reason=incomplete_reason)),
            instructions=r.instructions, max_output_tokens=r.max_output_tokens,
            parallel_tool_calls=r.parallel_tool_calls, store=r.store,
            previous_response_id=r.previous_response_id, background=r.background,
            reasoning=ReasoningOut(effort=r.reasoning_effort, summary=r.reasoning_summary),
            temperature=options.temperature, top_p=options.top_p,
            tool_choice=r.tool_choice, tools=list(r.tools), user=r.user,
            metadata=r.metadata,
            usage=None if usage is None else response_usage(usage))

    def _final(self, delta: Delta) -> Response:
        """Close every item and build the terminal Response (not for errors)."""
        if not self._calls():
            self._item("message")
        for item in self._items:
            item.status = "completed"
        if delta.finish_reason is FinishReason.LENGTH:
            self._items[-1].status = "incomplete"
            return self._response("incomplete", usage=delta.usage,
                                  incomplete_reason="max_output_tokens")
        return self._response("completed", usage=delta.usage)

    # -- streaming events

    def _event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self._seq,
                **{k: unstructure(v) for k, v in fields.items()}}
        self._seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _where(self, item: _OutputItem) -> dict:
        return {"item_id": item.id, "output_index": item.output_index, "content_index": 0}

    def _added(self, item: _OutputItem) -> bytes:
        part_event = ("response.reasoning_part.added" if item.kind == "reasoning"
                      else "response.content_part.added")
        return (self._event("response.output_item.added", output_index=item.output_index,
                            item=item.reply(with_content=False))
                + self._event(part_event, **self._where(item), part=item.part("")))

    def _text_delta(self, item: _OutputItem, text: str, logprobs=()) -> bytes:
        item.parts.append(text)
        if item.kind == "reasoning":
            return self._event("response.reasoning_text.delta", **self._where(item),
                               delta=text)
        item.logprobs += output_logprobs(logprobs)
        return self._event("response.output_text.delta", **self._where(item), delta=text,
                           logprobs=delta_logprobs(logprobs))

    def _answer_logprobs(self, delta: Delta) -> tuple:
        """The logprobs to show with this delta's answer text (call once per delta): a
        reasoning step's are not the answer's; a step with no text yet (a stop string's
        hold-back) keeps its own for the text that follows, and those no text follows (the
        end-of-turn token) are dropped."""
        if not self._wants_logprobs or (delta.reasoning and not delta.content):
            return ()
        self._held += delta.logprobs
        if not delta.content:
            return ()
        out, self._held = tuple(self._held), []
        return out

    def _done(self, item: _OutputItem) -> bytes:
        text = item.text
        if item.kind == "reasoning":
            text_done = self._event("response.reasoning_text.done", **self._where(item),
                                    text=text)
            part_done = self._event("response.reasoning_part.done", **self._where(item),
                                    part=item.part(text))
        else:
            text_done = self._event("response.output_text.done", **self._where(item),
                                    text=text, logprobs=delta_logprobs_of(item.logprobs))
            part_done = self._event("response.content_part.done", **self._where(item),
                                    part=item.part(text, item.logprobs))
        return text_done + part_done + self._event(
            "response.output_item.done", output_index=item.output_index, item=item.reply())

    def _open(self, kind: str) -> tuple[_OutputItem, bytes]:
        """The open item of this kind, with the events that close the previous
        item and announce a new one, when one is needed."""
        previous = self._items[-1] if self._items else None
        item, new = self._item(kind)
        if not new:
            return item, b""
        out = b""
        if previous is not None and previous.status == "in_progress":
            previous.status = "completed"
            out = self._done(previous)
        return item, out + self._added(item)

    # -- Framer API

    def start(self) -> bytes:
        if not self.req.stream:
            return b""
        created = self._response("in_progress")
        return (self._event("response.created", response=created)
                + self._event("response.in_progress", response=created))

    def _stream(self, delta: Delta) -> bytes:
        self._note(delta)
        out = []
        logprobs = self._answer_logprobs(delta)
        if delta.reasoning and self._takes_reasoning():
            item, opened = self._open("reasoning")
            out += [opened, self._text_delta(item, delta.reasoning)]
        reason = delta.finish_reason
        if delta.content or (reason is not None and reason is not FinishReason.ERROR
                             and not self._calls() and not delta.tool_calls):
            item, opened = self._open("message")
            out.append(opened)
            if delta.content:
                out.append(self._text_delta(item, delta.content, logprobs))
        for call in delta.tool_calls:
            out.append(self._stream_call(call))
        if reason is FinishReason.ERROR:
            message = delta.error or "The engine failed."
            for item in self._items:
                if item.status == "in_progress":
                    item.status = "incomplete"
            out.append(self._event("error", code="server_error", message=message, param=None))
            out.append(self._event("response.failed", response=self._response(
                "failed", usage=delta.usage, error=message)))
        elif reason is not None:
            last = self._items[-1]
            response = self._final(delta)
            if last.kind not in _CALL_KINDS:
                out.append(self._done(last))
            terminal = ("response.incomplete" if response.status == "incomplete"
                        else "response.completed")
            out.append(self._event(terminal, response=response))
        return b"".join(out)

    def _stream_call(self, call) -> bytes:
        """A whole function call: close the item before, then added, arguments delta and
        done, item done."""
        previous = self._items[-1] if self._items else None
        out = b""
        if previous is not None and previous.status == "in_progress":
            previous.status = "completed"
            out = self._done(previous)
        item = self._add_call(call)
        where = {"item_id": item.id, "output_index": item.output_index}
        out += self._event("response.output_item.added", output_index=item.output_index,
                           item=item.reply(with_content=False))
        item.status = "completed"
        if item.kind == "custom_tool_call":
            text = custom_input(call.arguments)
            out += self._event("response.custom_tool_call_input.delta", **where, delta=text)
            out += self._event("response.custom_tool_call_input.done", **where, input=text)
        else:
            out += self._event("response.function_call_arguments.delta", **where,
                               delta=call.arguments)
            out += self._event("response.function_call_arguments.done", **where,
                               name=call.name, arguments=call.arguments)
        return out + self._event("response.output_item.done", output_index=item.output_index,
                                 item=item.reply())

    def _accumulate(self, delta: Delta) -> bytes:
        self._note(delta)
        logprobs = self._answer_logprobs(delta)
        if delta.reasoning and self._takes_reasoning():
            self._item("reasoning")[0].parts.append(delta.reasoning)
        if delta.content:
            item = self._item("message")[0]
            item.parts.append(delta.content)
            item.logprobs += output_logprobs(logprobs)
        for call in delta.tool_calls:
            self._add_call(call)
        if delta.finish_reason is None:
            return b""
        if delta.finish_reason is FinishReason.ERROR:
            self.status = 500
            return error_bytes(delta)
        return json_body(self._final(delta))
