"""POST /v1/chat/completions: the request's prompt plan, and the reply's framing."""
from __future__ import annotations

import json
from typing import Any, ClassVar

import attrs

from stages.api.common import (ABSENT, Invalid, PromptPlan, RequestError, ToolSettings,
                               at_least, omit_absent, one_constraint, opt, reply)
from stages.api.framing import ChoicesFramer, ChoiceState, UsageInfo, prompt_logprobs_json
from stages.api.request_types import (ROUTER_EXTRAS, VLLM_EXTRAS, ChatMessage, ChoiceRequest,
                                      ContentPart, PartsText)
from stages.api.structured import constraint_of
from stages.api.tools import chat_tools, tool_request
from stages.delta import Delta, TokenLogprob, Usage
from stages.messages import ReplySpec

_ROUTER_CHAT_EXTRAS = {**ROUTER_EXTRAS, "separate_reasoning": (True,),
                       "stream_reasoning": (True,)}


@attrs.frozen
class ChatCompletionRequest(ChoiceRequest):
    messages: list[ChatMessage] = opt()
    max_completion_tokens: int | None = opt(at_least(1))
    logprobs: bool = opt(default=False)
    top_logprobs: int | None = opt()
    tools: list[dict[str, Any]] | None = opt()
    tool_choice: Any = opt()
    parallel_tool_calls: bool | None = opt()
    modalities: list[str] | None = opt()
    reasoning_effort: str | None = opt()
    include_reasoning: bool = opt(default=True)
    add_generation_prompt: bool = opt(default=True)
    continue_final_message: bool = opt(default=False)
    chat_template: str | None = opt()
    chat_template_kwargs: dict[str, Any] | None = opt()
    # options of the model's image processor (Qwen2.5-VL: min_pixels, max_pixels), as vLLM
    mm_processor_kwargs: dict[str, Any] | None = opt()
    prompt_cache_key: str | None = opt()                        # ignored
    safety_identifier: str | None = opt()                       # ignored
    verbosity: str | None = opt()                               # ignored
    _not_implemented: ClassVar[dict[str, Any]] = {
        **{k: v for k, v in VLLM_EXTRAS.items() if k != "mm_processor_kwargs"},
        **_ROUTER_CHAT_EXTRAS, "documents": (), "best_of": (1,), "media_io_kwargs": ()}

    @messages.validator
    def _messages(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)
        if not value:
            raise Invalid("must contain at least one message.", attribute.name)


# -- replies ----------------------------------------------------------------------------

@reply
class FunctionCall:
    name: str
    arguments: str            # a JSON string


@reply
class ToolCallOut:
    id: str
    type: str = "function"
    function: FunctionCall


@reply
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@reply
class ChatTokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@reply
class ChatLogprobs:
    content: list[ChatTokenLogprob]


@omit_absent
@reply
class FunctionChunk:
    name: str = ABSENT
    arguments: str = ABSENT


@omit_absent
@reply
class ToolCallChunk:
    """A streamed tool call: the first chunk has index, id, type and name; later ones
    carry the index and argument text."""
    index: int
    id: str = ABSENT
    type: str = ABSENT
    function: FunctionChunk


@omit_absent
@reply
class ChatDelta:
    role: str = ABSENT
    content: str = ABSENT
    reasoning: str = ABSENT
    tool_calls: list[ToolCallChunk] = ABSENT


@omit_absent
@reply
class ChatChunkChoice:
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = ABSENT      # on the final chunk only
    token_ids: list[int] = ABSENT               # return_token_ids: this chunk's tokens


@omit_absent
@reply
class ChatCompletionChunk:
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = ABSENT            # with include_usage: null but on the last chunk
    prompt_token_ids: list[int] = ABSENT        # return_token_ids: on the first chunk
    metrics: Any = ABSENT                       # per-request metrics: on the usage chunk


@omit_absent
@reply
class ChatMessageOut:
    role: str = "assistant"
    content: str | None
    refusal: str | None = None
    reasoning: str = ABSENT
    tool_calls: list[ToolCallOut] = ABSENT


@omit_absent
@reply
class ChatChoice:
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None          # return_token_ids


@omit_absent
@reply
class ChatCompletion:
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[Any] | None = None    # prompt_logprobs (vLLM's shape)
    prompt_token_ids: list[int] | None = None   # return_token_ids
    metrics: Any = ABSENT                       # --enable-per-request-metrics
    kv_transfer_params: Any = ABSENT            # a prefill instance's, for the decode side


MAX_LOGPROBS = 20   # vLLM's default --max-logprobs (and OpenAI's top_logprobs limit)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")   # OpenAI's (others pass on)
# chat_template_kwargs may not override what render itself decides.
_RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "add_generation_prompt", "tools",
                             "tokenize")


def plan(req: ChatCompletionRequest, *, reasoning_parser: bool,
         tools: ToolSettings = ToolSettings()) -> PromptPlan:
    check_n(req.n)
    tr = tool_request(chat_tools(req.tools), req.tool_choice, req.parallel_tool_calls, tools)
    constraint = one_constraint(constraint_of(req), tr.constraint, "structured outputs")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise RequestError("'modalities' other than [\"text\"] are not supported.",
                           param="modalities")
    if req.stream_options is not None and not req.stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true.",
                           param="stream_options")
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to true.", param="continue_final_message")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise RequestError("'continue_final_message' needs the last message to be an "
                           "assistant message.", param="continue_final_message")
    if req.max_tokens == 0:
        raise RequestError("'max_tokens' must be at least 1, got 0.", param="max_tokens")
    use_completion_tokens = req.max_completion_tokens is not None
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS}
    if req.reasoning_effort is not None:   # as vLLM: templates that know it use it
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    messages = template_messages(req.messages, "messages")
    if tr.template_tools is not None:
        kwargs["tools"] = tr.template_tools
    check_prompt_logprobs(req.prompt_logprobs, req.stream)
    prompt_logprobs = None if req.stream else req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs and not req.stream:
        prompt_logprobs = req.top_logprobs     # as vLLM: echo with top_logprobs asks for them
    return PromptPlan(
        # kv_transfer_params' ids are not the prompt when echo needs the messages' text
        messages=messages,
        # and not when a part is not text (a picture is rendered: vLLM's rule)
        token_ids=(None if req.echo or _has_media(messages)
                   else kv_prompt_token_ids(req.kv_transfer_params)),
        token_ids_param="kv_transfer_params.prompt_token_ids",
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        template_kwargs=kwargs, truncate=req.truncate_prompt_tokens,
        mm_processor_kwargs=req.mm_processor_kwargs,
        truncation_side=req.truncation_side or "left",
        add_special_tokens=bool(req.add_special_tokens), prompt_param="messages",
        max_tokens=req.max_completion_tokens if use_completion_tokens else req.max_tokens,
        max_tokens_param="max_completion_tokens" if use_completion_tokens else "max_tokens",
        logprobs=0 if req.logprob_token_ids else _logprobs(req), logprobs_param="top_logprobs",
        logprob_token_ids=logprob_token_ids(req.logprob_token_ids, bool(req.logprobs),
                                            "'logprobs' must be set to true"),
        stream=req.stream,
        stream_options=req.stream_options,
        constraint=constraint, tools=tr.plan, echo=_echo(req, messages),
        prompt_logprobs=prompt_logprobs,
        reply=reply_spec(req, reasoning_parser=reasoning_parser,
                         tool_parser=tools.enable_auto_tool_choice and bool(tools.tool_call_parser)))


def _has_media(messages: list[dict]) -> bool:
    return any(isinstance(m["content"], list) for m in messages)


def reply_spec(req: ChatCompletionRequest, *, reasoning_parser: bool = False,
               tool_parser: bool = False) -> ReplySpec:
    """What the chat reply shows of the request: token ids, tokens named by id, reasoning.
    As vLLM: include_reasoning false with any parser on (a reasoning parser, or the auto
    tool parser) drops every logprob and token id of the choices, so that nothing of the
    hidden reasoning can be decoded from them; only a reasoning parser's usage has
    completion_tokens_details."""
    return ReplySpec(return_token_ids=req.return_token_ids,
                     return_tokens_as_token_ids=req.return_tokens_as_token_ids,
                     include_reasoning=req.include_reasoning,
                     hide_token_metadata=not req.include_reasoning and (reasoning_parser
                                                                        or tool_parser),
                     reasoning_details=reasoning_parser)


def _echo(req: ChatCompletionRequest, messages: list[dict]) -> str | None:
    """echo: the reply starts with the final message's text when that message has the
    reply's role (assistant; without a generation prompt, the final message's own role),
    as vLLM."""
    if not req.echo:
        return None
    role = "assistant" if req.add_generation_prompt else req.messages[-1].role
    content = messages[-1]["content"]
    if isinstance(content, list):       # a picture's parts: the text of them
        content = "\n".join(p["text"] for p in content if p["type"] == "text")
    return content if req.messages[-1].role == role else ""


def kv_prompt_token_ids(params: dict | None) -> tuple[int, ...] | None:
    """kv_transfer_params.prompt_token_ids: the prompt, already rendered (as vLLM's
    disaggregated prefill hands it over). The rest of kv_transfer_params is the KV
    connector's (stages/api/kv_params.py)."""
    if not params or "prompt_token_ids" not in params:
        return None
    ids = params["prompt_token_ids"]
    param = "kv_transfer_params.prompt_token_ids"
    if (type(ids) is not list or not ids
            or not all(type(t) is int and t >= 0 for t in ids)):
        raise RequestError(f"'{param}' must be a non-empty array of non-negative integers.",
                           param=param)
    return tuple(ids)


MAX_N = 16   # choices per request: each is a sequence of the running batch
# Sequences per request (completions: prompts x n); schedule's inbox holds one
# FinishRequest for each.
MAX_CHOICES = 64


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be between 1 and {MAX_N}, got {n}.", param="n")


def check_prompt_logprobs(value: int | None, stream: bool) -> None:
    """prompt_logprobs: k alternatives per prompt token, or -1 for the whole vocabulary
    (render holds k to --max-logprobs); not with stream (vLLM's rule: streamed chunks have
    no field for them)."""
    if value is None:
        return
    if value < -1:
        raise RequestError(f"'prompt_logprobs' must be a non-negative integer, or -1 for the "
                           f"whole vocabulary; got {value}.", param="prompt_logprobs")
    if stream and value != 0:
        raise RequestError("'prompt_logprobs' are not available when 'stream' is true.",
                           param="prompt_logprobs")


def logprob_token_ids(ids: list[int] | None, logprobs: bool, needs: str) -> tuple[int, ...]:
    """logprob_token_ids (vLLM's): the ids whose logprobs every generated position reports,
    in place of the top alternatives; it needs logprobs on. Render checks them against the
    vocabulary."""
    if ids is None:
        return ()
    if not ids:
        raise RequestError("'logprob_token_ids' must not be an empty list.",
                           param="logprob_token_ids")
    if not logprobs:
        raise RequestError(f"when using 'logprob_token_ids', {needs}.",
                           param="logprob_token_ids")
    return tuple(ids)


def _logprobs(req: ChatCompletionRequest) -> int | None:
    """logprobs (bool) + top_logprobs (k, or -1: the whole vocabulary) -> None, or the
    number of alternatives (render holds it to --max-logprobs)."""
    top = req.top_logprobs
    if top is not None and top < -1:
        raise RequestError(f"'top_logprobs' must be a non-negative integer, or -1 for the "
                           f"whole vocabulary; got {top}.", param="top_logprobs")
    if not req.logprobs:
        if top:
            raise RequestError("'top_logprobs' needs 'logprobs' set to true.",
                               param="top_logprobs")
        return None
    return top or 0


def template_messages(messages: list[ChatMessage], param: str) -> list[dict]:
    """The messages as the chat template sees them."""
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not m.role:
            raise RequestError(f"'{where}.role' must be a non-empty string.",
                               param=f"{where}.role")
        # A role beyond CHAT_ROLES goes to the template as it is, as vLLM passes it: the
        # template renders it or raises (a 400 naming the template's complaint).
        if m.content is None and m.role != "assistant":
            raise RequestError(f"'{where}.content' must be a string or an array of content "
                               "parts, got null.", param=f"{where}.content")
        message = {"role": template_role(m.role),
                   "content": content_text(m.content, f"{where}.content", CHAT_PART_TYPES)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            message["tool_calls"] = template_tool_calls(m.tool_calls)
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is None:
            reasoning = _thinking(m.content)
        if reasoning is not None:
            # Templates read either name (Qwen3's reads reasoning_content).
            message["reasoning"] = message["reasoning_content"] = reasoning
        out.append(message)
    return out


class Arguments(dict):
    """Parsed arguments that remember the text they came from (`raw`), for formats that
    render the call exactly as the model wrote it (Harmony)."""
    raw: str = ""


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant's earlier calls as templates expect them: arguments as an object (as
    vLLM hands them over; Llama's and Qwen's templates `tojson` them)."""
    out = []
    for call in calls:
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                parsed = json.loads(fn["arguments"])
            except ValueError:
                pass
            else:
                if isinstance(parsed, dict):
                    parsed = Arguments(parsed)
                    parsed.raw = fn["arguments"]
                fn = {**fn, "arguments": parsed}
            call = {**call, "function": fn}
        out.append(call)
    return out


def template_role(role: str) -> str:
    # OpenAI's "developer" is the system prompt; most chat templates only know "system".
    return "system" if role == "developer" else role


# A chat message's parts: text, and what OpenAI's SDK and vLLM replay of an assistant turn
# (a refusal, the turn's thinking).
CHAT_PART_TYPES = ("text", "refusal", "thinking")


def _thinking(content) -> str | None:
    """A turn's `thinking` parts (content_text checked them) are its reasoning, not its
    text: templates that render reasoning (Qwen3's reasoning_content) put it back where
    the model wrote it, the others drop it, as they drop any earlier reasoning."""
    if content is None or isinstance(content, str):
        return None
    thinking = [p.thinking for p in content if p.type == "thinking"]
    return "\n".join(thinking) if thinking else None


# A picture's part (chat's image_url, the Responses API's input_image, vLLM's shorthand
# {"image_url": "..."}) comes out of content_text as {"type": "image", "image_url": URL,
# "param": ...}: render fetches it, or refuses it when the model takes text only.
IMAGE_PART_TYPES = ("image_url", "input_image")


def _image_url(part: ContentPart) -> object:
    url = part.image_url
    return url.get("url") if isinstance(url, dict) else url


def content_text(content: str | tuple[ContentPart, ...] | None, param: str,
                 part_types: tuple[str, ...]) -> str | list[dict]:
    """The text of a message's content, parts joined with a newline; with pictures, the
    parts in order as [{"type": "image", ...}, {"type": "text", "text": ...}]."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    parts: list[dict] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        # (as vLLM: a part without a type, or with a `uuid` whatever its type, is the
        # picture its image_url names)
        if part.type in IMAGE_PART_TYPES or ((part.type is None or part.uuid is not None)
                                             and part.image_url is not None):
            parts.append({"type": "image", "image_url": _image_url(part),
                          "param": f"{where}.image_url"})
            continue
        if part.type is None:
            raise RequestError(f"'{where}.type' is required.", param=f"{where}.type")
        media = part.type if part.type in ContentPart.MEDIA_KEYS else part.media_key
        if media is not None:
            raise RequestError(f"'{where}' is a {media} part: the served model takes text "
                               "only.", param=f"{where}.type")
        if part.type not in part_types:
            raise RequestError(f"'{where}.type' {part.type!r} is not supported; expected "
                               f"{' or '.join(part_types)}.", param=f"{where}.type")
        key, text = {"refusal": ("refusal", part.refusal),   # its text's key, and the text
                     "thinking": ("thinking", part.thinking)}.get(part.type, ("text", part.text))
        if text is None:
            raise RequestError(f"'{where}.{key}' must be a string.", param=f"{where}.{key}")
        if key != "thinking":      # the turn's reasoning (_thinking), not its text
            texts.append(text)
            parts.append({"type": "text", "text": text})
    if any(p["type"] == "image" for p in parts):
        return parts
    # vLLM joins text parts with a newline (its Harmony path, a tool result's with nothing)
    return PartsText.of(texts)


# -- the reply -----------------------------------------------------------------------------

def chat_logprobs(entries) -> ChatLogprobs:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
                         top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                       for t, v in e.top])
        for e in entries])


def _content_choice(index: int, content: str) -> ChatChunkChoice:
    return ChatChunkChoice(index=index, delta=ChatDelta(content=content), logprobs=None)


class ChatFramer(ChoicesFramer):
    chunk_type = ChatCompletionChunk
    body_type = ChatCompletion

    def __init__(self, req) -> None:
        super().__init__(req, f"chatcmpl-{req.request_id}")
        self._choices = [ChoiceState() for _ in range(req.n)]
        self._echo = req.echo[0] if req.echo else ""   # echo: the reply starts with it
        self._prompt_logprobs = None     # prompt_logprobs: brought by choice 0's first delta
        self._hidden = hidden = req.reply.hide_token_metadata
        self._wants_logprobs = req.sampling.options.logprobs is not None and not hidden
        self._show_reasoning = req.reply.include_reasoning
        self._return_ids = req.reply.return_token_ids      # the prompt's ids
        self._choice_ids = self._return_ids and not hidden   # each choice's own
        # no token ids or usage per chunk: a running choice's chunk is its content
        self._plain_stream = not (self._choice_ids or req.continuous_usage)

    def _visible(self, delta: Delta) -> tuple[str, tuple[TokenLogprob, ...], tuple[int, ...]]:
        """The reasoning text, logprobs and token ids to show: include_reasoning=false hides
        the reasoning (still counted); with a parser on, the logprobs and token ids of every
        token go too (hide_token_metadata), as vLLM."""
        reasoning = delta.reasoning if self._show_reasoning else ""
        if self._hidden:
            return reasoning, (), ()
        return reasoning, delta.logprobs, delta.token_ids

    def start(self) -> bytes:
        if not self.req.stream:
            return b""
        prompt = {"prompt_token_ids": list(self.req.prompt_token_ids)} if self._return_ids else {}
        usage = self._usage(Usage(len(self.req.prompt_token_ids), 0))
        out = [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))],
                           usage, **(prompt if i == 0 else {}))
               for i in range(self.req.n)]
        if self._echo:   # as vLLM: the echoed text, one chunk per choice, after the roles
            out += [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=self._echo))],
                                usage) for i in range(self.req.n)]
        return b"".join(out)

    def _stream(self, delta: Delta) -> bytes:
        if (self._plain_stream and delta.finish_reason is None and not delta.reasoning
                and not delta.tool_calls and not (self._wants_logprobs and delta.logprobs)):
            # a running choice's new content alone (what the general path below makes of it)
            return (self._chunk.text(delta.index, delta.content, _content_choice)
                    if delta.content else b"")
        out = []
        reasoning, logprobs, token_ids = self._visible(delta)
        lp = chat_logprobs(logprobs) if self._wants_logprobs and logprobs else None
        ids = self._choice_ids and bool(token_ids)
        usage = self._chunk_usage(delta)
        if delta.content or reasoning or lp or ids:
            message = (ChatDelta(content=delta.content, reasoning=reasoning) if reasoning
                       else ChatDelta(content=delta.content))
            choice = (ChatChunkChoice(index=delta.index, delta=message, logprobs=lp,
                                      token_ids=list(token_ids))
                      if ids else ChatChunkChoice(index=delta.index, delta=message, logprobs=lp))
            out.append(self._chunk([choice], usage))
        for call in delta.tool_calls:
            # OpenAI's shape: the call's index, id, type and name first, then its arguments.
            out.append(self._chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(
                tool_calls=[ToolCallChunk(index=call.index, id=call.id, type="function",
                                          function=FunctionChunk(name=call.name,
                                                                 arguments=""))]))], usage))
            out.append(self._chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(
                tool_calls=[ToolCallChunk(index=call.index, function=FunctionChunk(
                    arguments=call.arguments))]))], usage))
        out += self._stream_end(delta, usage)
        return b"".join(out)

    def _finish_choice(self, delta: Delta) -> ChatChunkChoice:
        return ChatChunkChoice(index=delta.index, delta=ChatDelta(),
                               finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)

    def _accumulate(self, delta: Delta) -> bytes:
        reasoning, logprobs, token_ids = self._visible(delta)
        if delta.prompt_logprobs:
            self._prompt_logprobs = delta.prompt_logprobs
        c = self._choices[delta.index]
        c.text.append(delta.content)
        c.reasoning.append(reasoning)
        c.logprobs.extend(logprobs)
        if self._choice_ids:
            c.token_ids.extend(token_ids)
        c.tool_calls.extend(ToolCallOut(id=t.id, function=FunctionCall(name=t.name,
                                                                       arguments=t.arguments))
                            for t in delta.tool_calls)
        return self._body_end(delta)

    def _body_fields(self) -> dict[str, Any]:
        # vLLM's body has these keys, null when not asked for
        return dict(
            prompt_logprobs=(prompt_logprobs_json(self._prompt_logprobs or ())
                             if self.req.sampling.prompt_logprobs is not None else None),
            prompt_token_ids=list(self.req.prompt_token_ids) if self._return_ids else None)

    def _body_choice(self, index: int, c: ChoiceState) -> ChatChoice:
        text, reasoning = self._echo + "".join(c.text), "".join(c.reasoning)
        extra = {"reasoning": reasoning} if reasoning else {}
        if c.tool_calls:
            extra["tool_calls"] = c.tool_calls
            text = text if text.strip() else None     # only the calls: content is null
        message = ChatMessageOut(content=text, **extra)
        return ChatChoice(index=index, message=message, finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason,
                          logprobs=chat_logprobs(c.logprobs) if self._wants_logprobs else None,
                          token_ids=c.token_ids if self._choice_ids else None)
