"""POST /v1/messages (Anthropic's Messages API): its request and prompt plan. Its replies
(message, event stream, errors) are stages/api/anthropic_framing.py.

The request maps onto what chat already renders: `system` and `messages` (content blocks:
text, image, tool_use, tool_result, thinking) become chat-template messages, `tools` and
`tool_choice` chat-form tools (so the same tool parsers find the calls), `output_format`
(or `output_config.format`) a JSON-schema constraint, `thinking` the template's
`enable_thinking`. The reply is a `message` of content blocks: thinking (the reasoning
parser's reasoning), text, tool_use, in the order the model wrote them.

What coding agents send is served as Anthropic's API serves it: `system`-role messages
inside `messages` (Claude Code >= 2.1.154) join the system prompt, in order, rather than
being rendered in place (a system turn between a tool call and its result breaks tool
calling: vllm#48874); `cache_control` on any block is accepted and ignored; thinking
blocks echoed back in history are the turn's reasoning; `thinking` on a model without a
reasoning parser runs without reasoning.
"""
from __future__ import annotations

import json
from typing import Any, Union

import attrs

from gpu.interface import Constraint
from stages.api.anthropic_framing import MessagesFramer, error_dict, error_type  # noqa: F401
from stages.api.chat import template_messages
from stages.api.common import (Invalid, PromptPlan, RequestError, ToolSettings, at_least,
                               between, converter, ignored_field, mismatch, one_constraint, opt,
                               structure_hook, structure_list, tolerant)
from stages.api.request_types import ChatMessage, ContentPart, SamplingRequest, StreamOptions
from stages.api.structured import named
from stages.api.tools import tool_request
from stages.messages import ReplySpec

API = "/v1/messages"


# -- the request ------------------------------------------------------------------------------

@attrs.frozen
class Block:
    """One content block of a message (or of `system`, or of a tool_result's content).
    Keys this server does not read (cache_control, citations) are tolerated."""
    type: str
    text: str | None = None
    id: str | None = None              # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None     # tool_result
    content: Any = None                # tool_result: a string or an array of blocks
    is_error: bool | None = None
    thinking: str | None = None        # thinking
    signature: str | None = None
    data: str | None = None            # redacted_thinking
    source: Any = None                 # image, document


Blocks = Union[str, list[Block]]


def _blocks(value: object, _: type) -> str | list[Block]:
    if type(value) is str:
        return value
    if type(value) is not list:
        raise mismatch("a string or an array of content blocks", value)
    return structure_list(value, list[Block])


structure_hook(Blocks, _blocks)


@attrs.frozen
class InputMessage:
    role: str
    content: Blocks


converter.register_structure_hook(Block, tolerant(Block))
converter.register_structure_hook(InputMessage, tolerant(InputMessage))

ROLES = ("user", "assistant")
_MEDIA = ("image", "document", "search_result")


@attrs.frozen
class MessagesBase(SamplingRequest):
    """What /v1/messages and /v1/messages/count_tokens share."""
    messages: list[InputMessage] = opt()
    system: Blocks | None = opt()
    tools: list[dict[str, Any]] | None = opt()
    tool_choice: dict[str, Any] | None = opt()
    thinking: dict[str, Any] | None = opt()
    output_format: dict[str, Any] | None = opt()     # the structured-outputs beta's name
    output_config: dict[str, Any] | None = opt()     # {"format": ..., "effort": ...}
    chat_template_kwargs: dict[str, Any] | None = opt()   # as vLLM's extension
    # Anthropic's, accepted and ignored (nothing here reads them)
    metadata: dict[str, Any] | None = opt()
    service_tier: str | None = opt()
    cache_control: Any = opt()
    inference_geo: str | None = opt()
    speed: str | None = opt()
    # Anthropic's server-side features (context_management, container, mcp_servers, ...) are
    # not fields here: ignored and logged, as vLLM; the prompt is served whole.

    @messages.validator
    def _messages(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)
        if not value:
            raise Invalid("must contain at least one message.", attribute.name)


@attrs.frozen
class MessagesRequest(MessagesBase):
    max_tokens: int | None = opt(at_least(1))        # required, as Anthropic's
    stop_sequences: list[str] | None = opt()
    # Anthropic's range (the SDK passes it through extra_body); absent, the generation
    # config's default applies, as vLLM's (else 1.0, Anthropic's default)
    temperature: float | None = opt(between(0.0, 1.0))
    # vLLM's sampling extensions, as on its other APIs
    frequency_penalty: float | None = opt(between(-2.0, 2.0))
    presence_penalty: float | None = opt(between(-2.0, 2.0))

    @max_tokens.validator
    def _max_tokens(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)

    @stop_sequences.validator
    def _stops(self, attribute, value) -> None:
        if value and any(s == "" for s in value):
            raise Invalid("cannot contain an empty string.", attribute.name)

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings, under the name render reads."""
        return tuple(self.stop_sequences or ())


@attrs.frozen
class CountTokensRequest(MessagesBase):
    """POST /v1/messages/count_tokens: a Messages request without the generation fields
    (max_tokens and the like are ignored, as any field it does not know)."""


# -- request -> chat form -------------------------------------------------------------------

def _text_of(content: Blocks | None, where: str) -> str:
    """The text of `system` (a string or text blocks), blocks joined with a newline."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if block.type != "text":
            raise RequestError(f"'{at}.type' {block.type!r} is not supported here; expected "
                               "text.", param=f"{at}.type")
        if block.text is None:
            raise RequestError(f"'{at}.text' must be a string.", param=f"{at}.text")
        texts.append(block.text)
    return "\n".join(texts)


def _image_part(block: Block, at: str) -> ContentPart:
    """An image block as chat's image part: a base64 source as a data URL, a url source
    as its URL. Render fetches it for a vision model, and refuses it for a text model."""
    source = block.source if isinstance(block.source, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise RequestError(f"'{at}.source' must be a base64 or url image source.",
                           param=f"{at}.source")
    return ContentPart(type="image_url", image_url={"url": url})


def _content(texts: list[str], images: list[tuple[int, ContentPart]]):
    """Text joined with newlines, or with pictures the parts in order (chat's content)."""
    if not images:
        return "\n".join(texts)
    parts = [ContentPart(type="text", text=t) for t in texts]
    for index, image in images:
        parts.insert(index, image)
    return tuple(parts)


def _tool_result(content: Any, where: str):
    """A tool_result's content: a string, or an array of text and image blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    problem = f"'{where}' must be a string or an array of text and image blocks."
    if not isinstance(content, list):
        raise RequestError(problem, param=where)
    try:
        blocks = structure_list(content, list[Block])
    except Exception:
        raise RequestError(problem, param=where) from None
    texts: list[str] = []
    images: list[tuple[int, ContentPart]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "image":
            images.append((len(texts) + len(images), _image_part(block, at)))
        elif block.type == "text" and block.text is not None:
            texts.append(block.text)
        else:
            raise RequestError(problem, param=f"{at}.type")
    return _content(texts, images)


def chat_messages(req: MessagesBase) -> list[dict]:
    """The request's system prompt and messages as chat messages (ChatMessage's fields).
    The system prompt is `system` then every system-role message's text, in order."""
    out: list[dict] = []
    system = [_text_of(req.system, "system")] if req.system is not None else []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "system":
            system.append(_text_of(m.content, f"{where}.content"))
            continue
        if m.role not in ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(ROLES)}, system; "
                               f"got {m.role!r}.", param=f"{where}.role")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        images: list[tuple[int, ContentPart]] = []
        calls, thinking = [], []
        for j, b in enumerate(m.content):
            at = f"{where}.content[{j}]"
            if b.type == "text":
                if b.text is None:
                    raise RequestError(f"'{at}.text' must be a string.", param=f"{at}.text")
                texts.append(b.text)
            elif b.type == "image" and m.role == "user":
                images.append((len(texts) + len(images), _image_part(b, at)))
            elif b.type in _MEDIA:
                raise RequestError(f"'{at}' is a {b.type} block: the served model takes text "
                                   "and images only.", param=f"{at}.type")
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise RequestError(f"'{at}.tool_use_id' is required.",
                                       param=f"{at}.tool_use_id")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": _tool_result(b.content, f"{at}.content")})
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    param = f"{at}.id" if not b.id else f"{at}.name"
                    raise RequestError(f"'{param}' is required.", param=param)
                if b.input is not None and not isinstance(b.input, dict):
                    raise RequestError(f"'{at}.input' must be an object.", param=f"{at}.input")
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type == "thinking" and m.role == "assistant":
                thinking.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue    # encrypted elsewhere: nothing this model can read
            else:
                raise RequestError(f"'{at}.type' {b.type!r} is not supported in a {m.role} "
                                   "message.", param=f"{at}.type")
        if not (texts or images or calls or thinking):
            continue        # a user turn of tool results only
        message: dict = {"role": m.role, "content": _content(texts, images)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning"] = "\n".join(thinking)
        out.append(message)
    system_text = "\n\n".join(filter(None, system))
    return ([{"role": "system", "content": system_text}] if system_text else []) + out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's custom tools ({name, description, input_schema}) in chat form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type", "custom")
        if kind != "custom":     # a server tool (web_search_...): Anthropic's servers run it
            if not isinstance(kind, str):
                raise RequestError(f"'{where}.type' must be a string.", param=f"{where}.type")
            ignored_field(API, f"tools[].type {kind}", "is a server tool, which this server "
                          "does not run: left out of the prompt")
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"'{where}.name' must be a non-empty string.",
                               param=f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(f"'{where}.input_schema' must be a JSON schema object.",
                               param=f"{where}.input_schema")
        fn = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None      # (only server tools: none to serve)


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) from Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("'tool_choice.name' must be a non-empty string.",
                               param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise RequestError("'tool_choice.type' must be one of auto, any, tool, none, got "
                       f"{json.dumps(kind)}.", param="tool_choice.type")


def _thinking_kwargs(req: MessagesBase, reasoning_parser: bool) -> dict:
    if req.thinking is None:
        return {}
    kind = req.thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind not in ("enabled", "adaptive"):
        raise RequestError("'thinking.type' must be one of enabled, adaptive, disabled, got "
                           f"{json.dumps(kind)}.", param="thinking.type")
    budget = req.thinking.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < 1):
        raise RequestError("'thinking.budget_tokens' must be a positive integer.",
                           param="thinking.budget_tokens")
    if not reasoning_parser:    # as vLLM: the model runs without reasoning
        ignored_field(API, "thinking", "asks for reasoning from a model served without "
                      "--reasoning-parser")
        return {}
    return {"enable_thinking": True}


def _output_constraint(req: MessagesBase) -> Constraint | None:
    fmt, param = req.output_format, "output_format"
    if fmt is None and req.output_config is not None:
        fmt, param = req.output_config.get("format"), "output_config.format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise RequestError(f"'{param}.type' must be \"json_schema\".", param=f"{param}.type")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"'{param}.schema' must be a JSON schema object.",
                           param=f"{param}.schema")
    return named(Constraint("json_schema", json.dumps(schema)), param)


_WITH_USAGE = StreamOptions(include_usage=True)


def template_inputs(req: MessagesBase, reasoning_parser: bool, tools: ToolSettings):
    """(chat messages, template kwargs, ToolRequest): what both the plan and count_tokens
    hand the chat template."""
    choice, parallel = _tool_choice(req.tool_choice)
    served = chat_tools(req.tools)
    tr = tool_request(served, choice if served or not req.tools else None, parallel, tools)
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.update(_thinking_kwargs(req, reasoning_parser))
    effort = (req.output_config or {}).get("effort")
    if isinstance(effort, str):
        kwargs.setdefault("reasoning_effort", effort)
    if tr.template_tools is not None:
        kwargs["tools"] = tr.template_tools
    return chat_messages(req), kwargs, tr


def _prefill(messages: list[dict]) -> bool:
    """A last assistant message is a prefill: the reply continues it, as Anthropic's does."""
    return messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")


def plan(req: MessagesRequest, *, reasoning_parser: bool,
         tools: ToolSettings = ToolSettings()) -> PromptPlan:
    messages, kwargs, tr = template_inputs(req, reasoning_parser, tools)
    if not messages:
        raise RequestError("'messages' must contain some content.", param="messages")
    constraint = one_constraint(_output_constraint(req), tr.constraint, "output_format")
    chat_form = template_messages([ChatMessage(**m) for m in messages], "messages")
    prefill = _prefill(messages)
    return PromptPlan(messages=chat_form, template_kwargs=kwargs, prompt_param="messages",
                      add_generation_prompt=not prefill, continue_final_message=prefill,
                      max_tokens=req.max_tokens, max_tokens_param="max_tokens",
                      stream=req.stream, stream_options=_WITH_USAGE, constraint=constraint,
                      tools=tr.plan, reply=reply_spec(req))


def reply_spec(req: MessagesRequest) -> ReplySpec:
    """Nothing of the request is echoed but the stop sequences, which the framer reads
    from the sampling params (a matched one is the message's stop_sequence)."""
    return ReplySpec()


def count_tokens_body(body: object, *, reasoning_parser: bool, tools: ToolSettings,
                      parse) -> dict:
    """The /tokenize body whose count is a count_tokens request's prompt length (`parse`:
    common.parse_request)."""
    req = parse(body, CountTokensRequest, "/v1/messages/count_tokens")
    messages, kwargs, _ = template_inputs(req, reasoning_parser, tools)
    if not messages:
        raise RequestError("'messages' must contain some content.", param="messages")
    tools_kw = kwargs.pop("tools", None)
    prefill = _prefill(messages)
    return {"model": req.model, "messages": messages, "chat_template_kwargs": kwargs,
            "add_generation_prompt": not prefill, "continue_final_message": prefill,
            **({"tools": tools_kw} if tools_kw is not None else {})}


