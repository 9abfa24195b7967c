"""POST /v1/responses: the request's prompt plan, and the Response or its event stream.

Stream order: response.created, response.in_progress; per output item (reasoning
first, when the model reasons, then the message): output_item.added,
reasoning_part/content_part.added, *_text.delta..., *_text.done,
reasoning_part/content_part.done, output_item.done; then one terminal event:
response.completed, response.incomplete (max_output_tokens) or error + response.failed.
"""
from __future__ import annotations

from typing import Any, ClassVar, Union

import attrs
import orjson

from stages.api.chat import content_text, template_role, template_tool_calls
from stages.api.common import (Content, Invalid, PromptPlan, RequestError, ResponseUsage,
                               SamplingRequest, Stop, StreamOptions, ToolSettings, at_least,
                               between, converter, mismatch, one_constraint, opt, reply,
                               structure_hook, structure_list, tolerant, unstructure)
from stages.api.framing import Framer, error_bytes, json_body, response_usage
from stages.api.structured import constraint_of
from stages.api.tools import responses_tools, tool_request
from stages.lib.delta import Delta, FinishReason
from stages.messages import ReplySpec, ResponseEcho

@attrs.frozen
class InputItem:
    """A Responses API input item (only messages are rendered)."""
    type: str = "message"
    role: str | None = None
    content: Content = None
    id: str | None = None
    status: str | None = None
    # function_call (an earlier call of the model) and function_call_output (its result)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content = None
    # reasoning (an earlier turn's, replayed from response.output): its content parts are
    # reasoning_text, its summary parts summary_text
    summary: Content = None


@attrs.frozen
class Reasoning:
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


@attrs.frozen
class TextFormat:
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen
class TextConfig:
    format: TextFormat | None = None
    verbosity: str | None = None


@attrs.frozen
class ResponsesRequest(SamplingRequest):
    input: Union[str, list[InputItem]] = opt()
    instructions: str | None = opt()
    max_output_tokens: int | None = opt(at_least(1))
    metadata: dict[str, Any] | None = opt()                     # echoed back
    parallel_tool_calls: bool = opt(default=True)
    tools: list[dict[str, Any]] | None = opt()
    tool_choice: Any = opt()
    text: TextConfig | None = opt()
    reasoning: Reasoning | None = opt()
    truncation: str = opt(default="disabled")
    include: list[str] | None = opt()
    top_logprobs: int | None = opt()
    store: bool | None = opt()                                  # ignored: nothing is stored
    service_tier: str | None = opt()                            # ignored
    prompt_cache_key: str | None = opt()                        # ignored
    safety_identifier: str | None = opt()                       # ignored
    stream_options: dict[str, Any] | None = opt()               # ignored
    max_tool_calls: int | None = opt()                          # ignored: no tools
    chat_template_kwargs: dict[str, Any] | None = opt()
    # vLLM accepts these on the Responses API as well
    stop: Stop | None = opt()
    frequency_penalty: float | None = opt(between(-2.0, 2.0))
    presence_penalty: float | None = opt(between(-2.0, 2.0))
    _not_implemented: ClassVar[dict[str, Any]] = {
        "previous_response_id": (), "conversation": (), "prompt": (), "background": (False,),
        "mm_processor_kwargs": (), "enable_response_messages": (False,),
        "previous_input_messages": ()}

    @input.validator
    def _input(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)
        if isinstance(value, list) and not value:
            raise Invalid("must contain at least one item.", attribute.name)


def _input(value: object, _: type) -> str | list[InputItem]:
    if type(value) is str:
        return value
    if type(value) is not list:
        raise mismatch("a string or an array of input items", value)
    return structure_list(value, list[InputItem])


structure_hook(Union[str, list[InputItem]], _input)


for _cls in (InputItem, Reasoning, TextFormat, TextConfig):
    converter.register_structure_hook(_cls, tolerant(_cls))


# -- Responses API replies ----------------------------------------------------------------

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
    store: bool = False              # nothing is ever stored
    temperature: float = 1.0
    text: TextOut = TextOut()
    tool_choice: Any = "auto"
    tools: list[Any] = attrs.field(factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)


RESPONSES_ROLES = ("system", "developer", "user", "assistant")
_WITH_USAGE = StreamOptions(include_usage=True)


def plan(req: ResponsesRequest, *, reasoning_parser: bool,
         tools: ToolSettings = ToolSettings()) -> PromptPlan:
    # Unlike chat, OpenAI's Responses API takes "tools": [] and "auto" without tools.
    choice = req.tool_choice if req.tools or req.tool_choice not in ("auto", "none") else None
    tr = tool_request(responses_tools(req.tools or None), choice, req.parallel_tool_calls,
                      tools)
    constraint = one_constraint(constraint_of(req), tr.constraint, "text.format")
    logprobs = _logprobs(req)
    if req.reasoning is not None and req.reasoning.effort is not None and not reasoning_parser:
        raise RequestError("'reasoning.effort' needs a reasoning model (serve with "
                           "--reasoning-parser).", param="reasoning.effort")
    if req.truncation != "disabled":
        raise RequestError("'truncation' other than \"disabled\" is not supported.",
                           param="truncation")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _input_messages(req.input)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)   # as chat's
    if tr.template_tools is not None:
        kwargs["tools"] = tr.template_tools
    return PromptPlan(messages=messages, template_kwargs=kwargs,
                      prompt_param="input", max_tokens=req.max_output_tokens,
                      max_tokens_param="max_output_tokens", stream=req.stream,
                      # the Response carries its usage, streamed or not
                      stream_options=_WITH_USAGE, constraint=constraint, tools=tr.plan,
                      logprobs=logprobs, reply=reply_spec(req))


def reply_spec(req: ResponsesRequest) -> ReplySpec:
    """What the Response repeats of its request, with a Response's defaults."""
    reasoning = req.reasoning if req.reasoning is not None else Reasoning()
    return ReplySpec(response=ResponseEcho(
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls, reasoning_effort=reasoning.effort,
        reasoning_summary=reasoning.summary, tool_choice=req.tool_choice or "auto",
        tools=tuple(req.tools or ()), user=req.user, metadata=req.metadata or {}))


OUTPUT_LOGPROBS = "message.output_text.logprobs"
# What OpenAI's `include` may ask for besides: data of tools and inputs this server does not
# have (no hosted tools, no images) or keep (no encrypted reasoning), so there is nothing
# to add.
_NOTHING_TO_INCLUDE = ("reasoning.encrypted_content", "file_search_call.results",
                       "web_search_call.results", "web_search_call.action.sources",
                       "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                       "message.input_image.image_url")


def _logprobs(req: ResponsesRequest) -> int | None:
    """include ["message.output_text.logprobs"]: the output text's logprobs, with
    top_logprobs (0-20) alternatives each (as OpenAI: top_logprobs alone returns nothing)."""
    from stages.api.chat import MAX_LOGPROBS
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {top}.",
                           param="top_logprobs")
    for i, what in enumerate(req.include or ()):
        if what != OUTPUT_LOGPROBS and what not in _NOTHING_TO_INCLUDE:
            raise RequestError(f"'include[{i}]' must be one of {OUTPUT_LOGPROBS}, "
                               f"{', '.join(_NOTHING_TO_INCLUDE)}; got {what!r}.",
                               param=f"include[{i}]")
    return (top or 0) if OUTPUT_LOGPROBS in (req.include or ()) else None


def _input_messages(raw) -> list[dict]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    messages: list[dict] = []
    reasoning: list[str] = []     # reasoning items waiting for the assistant turn they led to
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if item.type == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        if item.type in ("function_call", "function_call_output"):
            message = _function_item(item, where, messages)
        elif item.type != "message":
            raise RequestError(f"'{where}.type' {item.type!r} is not supported; only message, "
                               "reasoning, function_call and function_call_output items are.",
                               param=f"{where}.type")
        else:
            if item.role not in RESPONSES_ROLES:
                raise RequestError(f"'{where}.role' must be one of "
                                   f"{', '.join(RESPONSES_ROLES)}, got {item.role!r}.",
                                   param=f"{where}.role")
            if item.content is None:
                raise RequestError(f"'{where}.content' must be a string or an array of "
                                   "content parts, got null.", param=f"{where}.content")
            message = {"role": template_role(item.role), "content": content_text(
                item.content, f"{where}.content", ("input_text", "output_text", "text"))}
        if message["role"] == "assistant" and reasoning:
            # An earlier turn's reasoning goes with the answer or calls it led to, as chat's
            # history carries it: the template keeps it or drops it (Qwen3's keeps only the
            # last turn's), and Harmony renders it as the analysis message.
            text = "\n".join([*filter(None, [message.get("reasoning")]), *reasoning])
            message = {**message, "reasoning": text, "reasoning_content": text}
        reasoning = []   # (reasoning that led to no assistant turn has nowhere to go)
        messages.append(message)
    return messages


def _reasoning_text(item, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    if item.content:
        return content_text(item.content, f"{where}.content", ("reasoning_text",))
    return content_text(item.summary, f"{where}.summary", ("summary_text",))


def _function_item(item, where: str, messages: list[dict]) -> dict:
    """function_call -> an assistant message with tool_calls (consecutive calls join one
    message); function_call_output -> a tool message."""
    if item.call_id is None:
        raise RequestError(f"'{where}.call_id' is required.", param=f"{where}.call_id")
    if item.type == "function_call_output":
        if item.output is None:
            raise RequestError(f"'{where}.output' is required.", param=f"{where}.output")
        return {"role": "tool", "tool_call_id": item.call_id, "content": content_text(
            item.output, f"{where}.output", ("input_text", "output_text", "text"))}
    if item.name is None or item.arguments is None:
        param = f"{where}.name" if item.name is None else f"{where}.arguments"
        raise RequestError(f"'{param}' is required.", param=param)
    call = template_tool_calls([{"id": item.call_id, "type": "function", "function": {
        "name": item.name, "arguments": item.arguments}}])[0]
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        messages.pop()
        return {**last, "tool_calls": [*last["tool_calls"], call]}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


# -- the reply -----------------------------------------------------------------------------

class _OutputItem:
    """One output item of a Response while it is being built."""

    def __init__(self, kind: str, item_id: str, output_index: int, call=None) -> None:
        self.kind = kind                  # "reasoning" | "message" | "function_call"
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

    def reply(self, *, with_content: bool = True) -> MessageItem | ReasoningItem | FunctionCallItem:
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
        return any(item.kind == "function_call" for item in self._items)

    def _add_call(self, call) -> _OutputItem:
        item = _OutputItem("function_call", "fc_" + call.id.removeprefix("call_"),
                           len(self._items), call)
        self._items.append(item)
        return item

    def _response(self, status: str, *, usage=None, incomplete_reason: str | None = None,
                  error: str | None = None) -> Response:
        r = self._echo
        options = self.req.sampling.options
        return Response(
            id=self.id, created_at=self.req.created, status=status, model=self.req.model,
            output=[item.reply() for item in self._items],
            error=None if error is None else ResponseError(message=error),
            incomplete_details=(None if incomplete_reason is None
                                else IncompleteDetails(reason=incomplete_reason)),
            instructions=r.instructions, max_output_tokens=r.max_output_tokens,
            parallel_tool_calls=r.parallel_tool_calls,
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
            if last.kind != "function_call":
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
        out += self._event("response.function_call_arguments.delta", **where,
                           delta=call.arguments)
        item.status = "completed"
        out += self._event("response.function_call_arguments.done", **where, name=call.name,
                           arguments=call.arguments)
        return out + self._event("response.output_item.done", output_index=item.output_index,
                                 item=item.reply())

    def _accumulate(self, delta: Delta) -> bytes:
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
