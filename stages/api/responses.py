"""POST /v1/responses: the request and its prompt plan. The Response and its event
stream are stages/api/responses_framing.py.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Union

import attrs

from stages.api.chat import content_text, template_role, template_tool_calls
from stages.api.common import (Invalid, PromptPlan, RequestError, ToolSettings, at_least,
                               between, converter, ignored_field, mismatch, one_constraint, opt,
                               structure_hook, structure_list, tolerant)
from stages.api.request_types import Content, SamplingRequest, Stop, StreamOptions
from stages.api.structured import constraint_of
from stages.api.tools import CUSTOM_INPUT, responses_tools, tool_request
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
    input: str | None = None               # custom_tool_call: the tool's free-text input
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
    # Stateful Responses (web/responses_routes.py keeps them): render sees previous_response_id's
    # conversation already put in front of `input`; the reply echoes these three.
    store: bool | None = opt()                 # None: true, OpenAI's default
    previous_response_id: str | None = opt()
    background: bool = opt(default=False)
    service_tier: str | None = opt()                            # ignored
    prompt_cache_key: str | None = opt()                        # ignored
    safety_identifier: str | None = opt()                       # ignored
    stream_options: dict[str, Any] | None = opt()               # ignored
    max_tool_calls: int | None = opt()                          # ignored: no tools
    chat_template_kwargs: dict[str, Any] | None = opt()
    mm_processor_kwargs: dict[str, Any] | None = opt()   # the image processor's options
    # vLLM accepts these on the Responses API as well
    stop: Stop | None = opt()
    frequency_penalty: float | None = opt(between(-2.0, 2.0))
    presence_penalty: float | None = opt(between(-2.0, 2.0))
    # vLLM's: the Response carries the rendered prompt and the model's output, with their
    # token ids (input_messages, output_messages)
    enable_response_messages: bool = opt(default=False)
    _not_implemented: ClassVar[dict[str, Any]] = {
        "conversation": (), "prompt": (),
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


API = "/v1/responses"
RESPONSES_ROLES = ("system", "developer", "user", "assistant")
_WITH_USAGE = StreamOptions(include_usage=True)


def plan(req: ResponsesRequest, *, reasoning_parser: bool,
         tools: ToolSettings = ToolSettings()) -> PromptPlan:
    served = responses_tools(req.tools or None)
    tr = tool_request(served, _tool_choice(req.tool_choice, served), req.parallel_tool_calls,
                      tools)
    constraint = one_constraint(constraint_of(req), tr.constraint, "text.format")
    logprobs = _logprobs(req)
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and not reasoning_parser:   # as vLLM: served without reasoning
        ignored_field(API, "reasoning.effort", "asks for reasoning from a model served "
                      "without --reasoning-parser")
        effort = None
    if req.background and req.store is False:
        raise RequestError("'background' needs 'store' true: a background response is read "
                           "back from the store.", param="background")
    if req.truncation != "disabled":
        raise RequestError("'truncation' other than \"disabled\" is not supported.",
                           param="truncation")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _input_messages(req.input)
    kwargs = dict(req.chat_template_kwargs or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)   # as chat's
    if tr.template_tools is not None:
        kwargs["tools"] = tr.template_tools
    return PromptPlan(messages=messages, template_kwargs=kwargs,
                      prompt_param="input", max_tokens=req.max_output_tokens,
                      max_tokens_param="max_output_tokens", stream=req.stream,
                      # the Response carries its usage, streamed or not
                      stream_options=_WITH_USAGE, constraint=constraint, tools=tr.plan,
                      logprobs=logprobs, logprobs_param="top_logprobs", reply=reply_spec(req),
                      mm_processor_kwargs=req.mm_processor_kwargs)


def _tool_choice(choice: Any, served: list[dict] | None) -> Any:
    """tool_choice in chat's terms, for the tools served. Unlike chat, OpenAI's Responses
    API takes "auto" (and "none") without tools; a custom tool is named as a function; a
    hosted tool's choice (or allowed_tools') is "auto" over the tools served."""
    if isinstance(choice, dict) and choice.get("type") == "custom":
        return {"type": "function", "name": choice.get("name")}
    if isinstance(choice, dict) and choice.get("type") != "function":
        ignored_field(API, f"tool_choice.type {choice.get('type')}", "names a tool this "
                      "server does not run: \"auto\" instead")
        choice = "auto"
    return choice if served or choice not in ("auto", "none") else None


def reply_spec(req: ResponsesRequest) -> ReplySpec:
    """What the Response repeats of its request, with a Response's defaults."""
    reasoning = req.reasoning if req.reasoning is not None else Reasoning()
    return ReplySpec(response=ResponseEcho(
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls, reasoning_effort=reasoning.effort,
        reasoning_summary=reasoning.summary, tool_choice=req.tool_choice or "auto",
        tools=tuple(req.tools or ()), user=req.user, metadata=req.metadata or {},
        store=req.store is not False, previous_response_id=req.previous_response_id,
        background=req.background,
        prompt_text="" if req.enable_response_messages else None))   # render fills it in


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
        if item.type in _CALL_ITEMS:
            message = _function_item(item, where, messages)
        elif item.type != "message":
            # a hosted tool's call (web_search_call, ...) or an item kind this server does
            # not know: nothing the model wrote or read here, so left out (logged once)
            ignored_field(API, f"input[].type {item.type}", "is an item this server does not "
                          "render: left out of the prompt")
            continue
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


_CALL_ITEMS = ("function_call", "function_call_output", "custom_tool_call",
               "custom_tool_call_output")


def _function_item(item, where: str, messages: list[dict]) -> dict:
    """function_call (custom_tool_call) -> an assistant message with tool_calls
    (consecutive calls join one message); function_call_output (custom_tool_call_output)
    -> a tool message. A custom tool's input is the call's one string argument."""
    if item.call_id is None:
        raise RequestError(f"'{where}.call_id' is required.", param=f"{where}.call_id")
    if item.type.endswith("_output"):
        if item.output is None:
            raise RequestError(f"'{where}.output' is required.", param=f"{where}.output")
        return {"role": "tool", "tool_call_id": item.call_id, "content": content_text(
            item.output, f"{where}.output", ("input_text", "output_text", "text"))}
    key = "input" if item.type == "custom_tool_call" else "arguments"
    value = item.input if key == "input" else item.arguments
    if item.name is None or value is None:
        param = f"{where}.name" if item.name is None else f"{where}.{key}"
        raise RequestError(f"'{param}' is required.", param=param)
    arguments = json.dumps({CUSTOM_INPUT: value}) if key == "input" else value
    call = template_tool_calls([{"id": item.call_id, "type": "function", "function": {
        "name": item.name, "arguments": arguments}}])[0]
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        messages.pop()
        return {**last, "tool_calls": [*last["tool_calls"], call]}
    return {"role": "assistant", "content": "", "tool_calls": [call]}
