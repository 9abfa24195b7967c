"""render: HTTP request body -> RenderedRequest (token ids + sampling params).

The body is structured into its API's typed request, which maps itself to a PromptPlan
(the API's module in stages/api, found through `stages.api.APIS`). render owns the rest: the chat template,
tokenisation, the max_tokens rules and sampling defaults from generation_config. A bad
request raises RequestError here, before any HTTP response has started.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs
import jinja2

from gpu.interface import LoRARef, SamplingOptions
from gpu.lora.spec import LoRARegistry
from gpu.config.pooling import PoolingSpec
from stages.api import harmony
from stages.api import APIS, chat
from stages.api.common import PromptPlan, RequestError, ToolSettings, parse_request, usage_flags
from stages.api.request_types import ChoiceRequest
from stages.api.responses import ResponsesRequest
from stages.api.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                 TokenizeResponse)
from stages.api.pooling import INVOCATION_INPUT, INVOCATION_MESSAGES, POOLING_APIS, POOLING_PATHS
from stages.api.kv_params import KVTransferConfig, kv_transfer, notify_refused, refused_remote_prefill
from stages.media.fetch import MediaError, MediaSettings
from stages.api.pooling_inputs import check_truncation, input_ids
from stages.api.sampling_checks import (beam_width_of, check_vocab, held_logprobs, logit_controls,
                                         thinking_budget, vocab_size)
from stages.media.prompt import check_limit, expand, image_parts, load_images, template_form
from stages.messages import PoolingWork, RenderedRequest, ReplySpec, SamplingParams, Submission

if TYPE_CHECKING:
    from gpu.tokenizers.tokenizer import Tokenizer
    from gpu.config.vision import VisionSpec

__all__ = ["RenderContext", "RequestError", "render", "run"]

@attrs.frozen
class RenderContext:
    tokenizer: Tokenizer | None   # None: --skip-tokenizer-init (prompts and replies are ids)
    served_model_names: tuple[str, ...]
    max_model_len: int
    # generation_config defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens...); used when the request omits a field.
    default_sampling: dict = attrs.field(factory=dict)
    reasoning: bool = False       # a reasoning parser is active
    vocab_size: int | None = None  # the model's embedding rows: token ids must be below it
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's
    max_tokens_ceiling: int | None = None  # --override-generation-config's max_new_tokens
    force_include_usage: bool = False  # --enable-force-include-usage
    per_request_metrics: bool = False  # --enable-per-request-metrics
    tools: ToolSettings = ToolSettings()   # --enable-auto-tool-choice, --tool-call-parser...
    harmony: bool = False         # gpt-oss: messages render through Harmony (stages/api/harmony.py)
    mistral: bool = False         # --tokenizer-mode mistral: mistral-common renders chats
    pooling: PoolingSpec | None = None   # a pooling model (--runner pooling): what it does
    priority_scheduling: bool = False    # --scheduling-policy priority: `priority` is served
    think_tags: bool = True   # <think>/</think> are single tokens (thinking_token_budget needs it)
    vision: VisionSpec | None = None     # a vision-language model: its pictures' processing
    media: MediaSettings = MediaSettings()   # fetching pictures: the media flags
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    max_logprobs: int = 20               # --max-logprobs: alternatives per token (-1: all)
    # --enable-lora: the served adapters (gpu/lora/spec.py LoRARegistry, changed at run time
    # by the load/unload endpoints); a request's `model` may name one
    loras: LoRARegistry | None = None
    kv_transfer: KVTransferConfig | None = None   # --kv-transfer-config: the KV connector's roles


def render(sub: Submission, ctx: RenderContext) -> RenderedRequest:
    """Validate one API call, render its prompt and resolve its sampling params.

    Raises RequestError (4xx, OpenAI-shaped) for anything the client got wrong.
    """
    if sub.api == INVOCATION_MESSAGES and ctx.pooling is None:
        sub = attrs.evolve(sub, api="chat")
    elif sub.api in (INVOCATION_INPUT, INVOCATION_MESSAGES):   # as vLLM: a pooling request
        task = ctx.pooling.task if ctx.pooling is not None else "embed"
        sub = attrs.evolve(sub, api="classify" if task == "classify" else "embeddings")
    if sub.api in POOLING_APIS:
        return render_pooling(sub, ctx)
    api = APIS.get(sub.api)
    if api is None:
        raise RequestError(f"Unknown API {sub.api!r}.", status=404, type="not_found_error")
    if ctx.pooling is not None:
        raise RequestError(f"The model `{ctx.served_model_names[0]}` is a pooling model (--runner "
                           f"pooling): it does not serve {api.path}; use /v1/embeddings, /pooling, "
                           f"/score, /rerank or /classify.", param="model")
    req = parse_request(sub.body, api.request, api.path)
    if ctx.tokenizer is None and isinstance(req, ChoiceRequest):
        req = attrs.evolve(req, return_token_ids=True)   # no text to send: send the ids
    model = _resolve_model(req.model, ctx)
    priority = getattr(req, "priority", 0)
    if priority != 0 and not ctx.priority_scheduling:   # as vLLM
        raise RequestError(f"Got priority {priority} but priority scheduling is not "
                           "enabled (start the server with --scheduling-policy priority).",
                           param="priority")
    plan = held_logprobs(api.plan(req, reasoning_parser=ctx.reasoning, tools=ctx.tools), ctx)
    sampling = _sampling_options(req, plan, ctx)
    parts = image_parts(plan.messages) if plan.messages is not None else []
    images = ()
    if parts:
        ids, images = _vision_ids(plan, ctx, parts)
        prompts = [ids]
    elif plan.batch is None:
        prompts = [_prompt_ids(plan, ctx)]
    else:   # several prompts: each rendered (and checked) on its own, named by its place
        prompts = [_prompt_ids(attrs.evolve(
            plan, text=p if isinstance(p, str) else None,
            token_ids=None if isinstance(p, str) else p, prompt_param=f"prompt[{i}]"), ctx)
            for i, p in enumerate(plan.batch)]
    limits = [_resolve_max_tokens(ctx, len(ids), plan) for ids in prompts]
    max_tokens = limits[0]
    if sampling.min_tokens > min(limits):
        raise RequestError(f"'min_tokens' ({sampling.min_tokens}) must be at most the "
                           f"maximum number of tokens to generate ({min(limits)}).",
                           param="min_tokens")
    ids = prompts[0]
    n = req.n if isinstance(req, ChoiceRequest) else 1   # the Responses API has one choice
    beam_width = beam_width_of(req, plan, limits) if isinstance(req, ChoiceRequest) else 0
    include_usage, continuous_usage = usage_flags(plan.stream, plan.stream_options,
                                                  force=ctx.force_include_usage)
    return RenderedRequest(
        request_id=sub.request_id, api=sub.api, model=model, prompt_token_ids=tuple(ids),
        sampling=SamplingParams(
            max_tokens=max_tokens, options=sampling, stop=req.stop or (),
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, constraint=plan.constraint,
            prompt_logprobs=plan.prompt_logprobs, beam_width=beam_width,
            length_penalty=float(req.length_penalty) if beam_width else 1.0),
        stream=plan.stream,
        include_usage=include_usage,
        created=int(time.time()), arrival=sub.arrival,
        reply=_reply(plan, ctx, ids),
        images=images,
        continuous_usage=continuous_usage,
        cache_salt=req.cache_salt or None,
        # per-request metrics describe one sequence: not with n > 1 or several prompts
        per_request_metrics=(ctx.per_request_metrics and n == 1
                             and len(prompts) == 1),
        n=n, tools=plan.tools,
        prompts=tuple(map(tuple, prompts)) if len(prompts) > 1 else (),
        prompt_max_tokens=tuple(limits) if len(prompts) > 1 else (),
        echo=_echo(plan, req, prompts, ctx), priority=priority,
        lora=_lora(model, ctx), kv_transfer=kv_transfer(  # after every other check
            getattr(req, "kv_transfer_params", None), ctx.kv_transfer, n, len(prompts),
            plan.prompt_logprobs, plan.stream, api.path))



def _text_only(part: dict) -> RequestError:
    where = part["param"].removesuffix(".image_url")
    return RequestError(f"'{where}' is a image_url part: the served model takes text only.",
                        param=f"{where}.type")


def _vision_ids(plan: PromptPlan, ctx: RenderContext, parts: list[dict]):
    """The prompt's token ids with each picture's placeholders, and the pictures (fetched
    and processed): a RequestError (400) naming the part that cannot be had."""
    if ctx.vision is None:
        raise _text_only(parts[0])
    if plan.truncate is not None:
        raise RequestError("'truncate_prompt_tokens' does not combine with images (it could "
                           "cut a picture's tokens).", param="truncate_prompt_tokens")
    try:
        check_limit(parts, ctx.media)
        loaded = load_images(parts, ctx.vision, ctx.media, plan.mm_processor_kwargs)
        template = plan.chat_template or ctx.chat_template or (
            ctx.tokenizer.chat_template if ctx.tokenizer is not None else None)
        messages = template_form(plan.messages, template, ctx.vision)
        ids = _prompt_ids(attrs.evolve(plan, messages=messages), ctx)
        return expand(ids, ctx.vision, loaded, plan.prompt_param)
    except MediaError as err:
        raise RequestError(err.message, param=err.param) from None


def has_images(body: object) -> bool:
    """Whether a request body may name pictures (render then runs it in a worker thread:
    fetching and decoding them takes time)."""
    if not isinstance(body, dict):
        return False
    items = body.get("messages") if "messages" in body else body.get("input")
    if not isinstance(items, list):
        return False
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list) and any(
                isinstance(p, dict) and ("image_url" in p or p.get("type") == "input_image")
                for p in content):
            return True
    return False


def render_pooling(sub: Submission, ctx: RenderContext) -> RenderedRequest:
    """A pooling request (stages/api/pooling.py): each input tokenized, truncated or refused
    when too long (stages/api/pooling_inputs.py), one sequence each."""
    cls, make_plan = POOLING_APIS[sub.api]
    req = parse_request(sub.body, cls, POOLING_PATHS[sub.api])
    model = _resolve_model(req.model, ctx)
    if ctx.pooling is None:
        raise RequestError(f"The model `{model}` generates text: it does not serve "
                           f"{POOLING_PATHS[sub.api]} (start the server with --runner pooling and an "
                           f"embedding or classification model).", param="model")
    plan = make_plan(req, ctx.pooling)
    vocab = vocab_size(ctx)
    if plan.messages is not None:
        if ctx.tokenizer is None:
            raise RequestError("This server has no tokenizer: 'messages' cannot be rendered.",
                               param="messages")
        messages = chat.template_messages(list(plan.messages), "messages")
        if image_parts(messages):
            raise _text_only(image_parts(messages)[0])
        chat_plan = PromptPlan(messages=messages,
                               add_generation_prompt=plan.add_generation_prompt,
                               continue_final_message=plan.continue_final_message,
                               chat_template=plan.chat_template, template_kwargs=plan.template_kwargs,
                               prompt_param="messages", max_tokens=None, max_tokens_param="")
        encoded = [input_ids(plan.inputs[0], ctx.tokenizer, ctx.max_model_len, vocab,
                             text=_apply_template(ctx, chat_plan))]
    else:
        encoded = [input_ids(inp, ctx.tokenizer, ctx.max_model_len, vocab) for inp in plan.inputs]
    prompts = tuple(tuple(ids) for ids, _ in encoded)
    segments = tuple(seg for _, seg in encoded)
    return RenderedRequest(
        request_id=sub.request_id, api=sub.api, model=model, prompt_token_ids=prompts[0],
        sampling=SamplingParams(max_tokens=0), stream=False, include_usage=True,
        created=int(time.time()), arrival=sub.arrival, reply=ReplySpec(),
        prompts=prompts if len(prompts) > 1 else (),
        pooling=PoolingWork(plan.options, plan.reply, segments if any(segments) else ()))


def _echo(plan: PromptPlan, req, prompts: list[list[int]], ctx: RenderContext
          ) -> tuple[str, ...] | None:
    """What each prompt's choices start with under echo: chat, the final message's text;
    completions, the prompt as sent (decoded when it was token ids or truncated; nothing
    when return_token_ids sends the prompt's ids instead, as vLLM)."""
    if plan.echo is not None:
        return (plan.echo,)
    if not plan.echo_prompt:
        return None
    batch = plan.batch if plan.batch is not None else (
        plan.text if plan.token_ids is None else plan.token_ids,)
    out = []
    for given, ids in zip(batch, prompts):
        if req.return_token_ids or ctx.tokenizer is None:
            out.append("")
        elif isinstance(given, str) and plan.truncate is None:
            out.append(given)
        else:
            out.append(ctx.tokenizer.decode(ids, skip_special_tokens=False))
    return tuple(out)


def tokenize(body: object, ctx: RenderContext) -> TokenizeResponse:
    """POST /tokenize: the prompt's token ids as render would make them (chat template
    included for `messages`), without running anything."""
    req = parse_request(body, TokenizeRequest, "/tokenize")
    _resolve_model(req.model, ctx)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("Send exactly one of 'prompt' and 'messages'.", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise RequestError("'messages' must contain at least one message.",
                               param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        messages = chat.template_messages(req.messages, "messages")
        plan = PromptPlan(messages=messages,
                          add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message,
                          chat_template=req.chat_template, template_kwargs=kwargs,
                          add_special_tokens=bool(req.add_special_tokens),
                          prompt_param="messages", max_tokens=None, max_tokens_param="",
                          mm_processor_kwargs=req.mm_processor_kwargs)
        if image_parts(messages):     # fetched and expanded as for a chat (web/app.py: a thread)
            if ctx.tokenizer is None:
                raise RequestError("This model was loaded without a tokenizer.", param="prompt")
            ids = _vision_ids(plan, ctx, image_parts(messages))[0]
            strs = [ctx.tokenizer.hf.id_to_token(t) for t in ids] if req.return_token_strs else None
            return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                                    token_strs=strs)
    else:
        plan = PromptPlan(text=req.prompt, prompt_param="prompt", max_tokens=None,
                          max_tokens_param="",
                          add_special_tokens=req.add_special_tokens is not False)
    if ctx.tokenizer is None:
        raise RequestError("This model was loaded without a tokenizer.", param="prompt")
    ids = _prompt_ids(plan, ctx) if plan.text != "" else []
    strs = [ctx.tokenizer.hf.id_to_token(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(body: object, ctx: RenderContext) -> DetokenizeResponse:
    """POST /detokenize: token ids back to text."""
    req = parse_request(body, DetokenizeRequest, "/detokenize")
    _resolve_model(req.model, ctx)
    if ctx.tokenizer is None:
        raise RequestError("This model was loaded without a tokenizer.", param="tokens")
    check_vocab(req.tokens, vocab_size(ctx), "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))


def tokenizer_info(ctx: RenderContext) -> dict:
    """GET /tokenizer_info (vLLM's): the tokenizer's configuration, as tokenizer_config.json
    would give it, with the chat template the server applies."""
    tok = ctx.tokenizer
    if tok is None:
        raise RequestError("This model was loaded without a tokenizer.", status=404,
                           type="NotFoundError")
    return {"tokenizer_class": "PreTrainedTokenizerFast",   # what a tokenizers.Tokenizer is in HF
            "chat_template": ctx.chat_template or tok.chat_template,
            "model_max_length": ctx.max_model_len, "bos_token": tok.bos_token,
            "eos_token": tok.eos_token, "vocab_size": tok.vocab_size}


def _resolve_model(name: str | None, ctx: RenderContext) -> str:
    """Replies name the first served model, whichever alias the request used; like vLLM,
    an absent or empty model means the default (first) one."""
    if name and ctx.loras is not None and name in ctx.loras:
        return name      # a LoRA adapter: replies name it, as vLLM's do
    if name and name not in ctx.served_model_names:
        raise RequestError(f"The model `{name}` does not exist.", status=404,
                           type="NotFoundError", param="model", code="model_not_found")
    return ctx.served_model_names[0]


def _lora(model: str, ctx: RenderContext) -> LoRARef | None:
    served = ctx.loras.get(model) if ctx.loras is not None else None
    return served.ref if served is not None else None


def _reply(plan: PromptPlan, ctx: RenderContext, ids: list[int]) -> ReplySpec:
    """The plan's ReplySpec, with the server's prompt_tokens_details, and for a Response
    with enable_response_messages the rendered prompt: its ids decoded with their special
    tokens (the template's text, as the model reads it: the ids win where they differ)."""
    reply = plan.reply
    if ctx.prompt_tokens_details:
        reply = attrs.evolve(reply, prompt_tokens_details=True)
    if reply.response is not None and reply.response.prompt_text is not None:
        text = ("" if ctx.tokenizer is None
                else ctx.tokenizer.decode(ids, skip_special_tokens=False))
        reply = attrs.evolve(reply, response=attrs.evolve(
            reply.response, prompt_text=text, prompt_token_ids=tuple(ids)))
    return reply


def _sampling_options(req: ChoiceRequest | ResponsesRequest, plan: PromptPlan,
                      ctx: RenderContext) -> SamplingOptions:
    """The request's sampling fields (every API's request has the sampler's); generation_config,
    then the sampler's defaults, fill the ones it left out."""
    defaults = ctx.default_sampling
    fields = attrs.fields_dict(SamplingOptions)

    def pick(name: str, value: Any) -> Any:
        if value is None:
            value = defaults.get(name)
        return fields[name].default if value is None else value

    stop_ids = req.stop_token_ids
    outside = [i for i in stop_ids if ctx.vocab_size is not None and i >= ctx.vocab_size]
    if outside:
        raise RequestError(f"'stop_token_ids' contains {outside[0]}, which is out of "
                           f"vocabulary: token ids must be below the vocabulary size "
                           f"{ctx.vocab_size}.", param="stop_token_ids")
    return SamplingOptions(
        temperature=float(pick("temperature", req.temperature)),
        top_p=float(pick("top_p", req.top_p)), top_k=pick("top_k", req.top_k),
        min_p=float(pick("min_p", req.min_p)), seed=req.seed,
        repetition_penalty=float(pick("repetition_penalty", req.repetition_penalty)),
        frequency_penalty=float(pick("frequency_penalty", req.frequency_penalty)),
        presence_penalty=float(pick("presence_penalty", req.presence_penalty)),
        min_tokens=req.min_tokens, stop_token_ids=stop_ids, logprobs=plan.logprobs,
        logprob_token_ids=plan.logprob_token_ids,
        thinking_token_budget=thinking_budget(req, ctx),
        **(logit_controls(req, ctx) if isinstance(req, ChoiceRequest) else {}))


def _prompt_ids(plan: PromptPlan, ctx: RenderContext) -> list[int]:
    if plan.token_ids is not None:
        param = plan.token_ids_param or plan.prompt_param
        check_vocab(plan.token_ids, vocab_size(ctx), param, negative=True)
        return _truncated(list(plan.token_ids), plan, ctx)
    if ctx.tokenizer is None:
        raise RequestError("This server has no tokenizer: prompts must be token ids "
                           "(/v1/completions with a prompt of token ids, or chat with "
                           "kv_transfer_params.prompt_token_ids).", param=plan.prompt_param)
    if plan.messages is not None and ctx.harmony:
        return _truncated(_harmony_ids(plan), plan, ctx)
    if plan.messages is not None and ctx.mistral:
        return _truncated(_mistral_ids(plan, ctx), plan, ctx)
    if plan.messages is not None:
        text = _apply_template(ctx, plan)
    else:
        text = plan.text
    ids = ctx.tokenizer.encode(text, add_special_tokens=plan.add_special_tokens)
    if not ids:
        raise RequestError(f"'{plan.prompt_param}' must not be empty.", param=plan.prompt_param)
    return _truncated(ids, plan, ctx)


def _truncated(ids: list[int], plan: PromptPlan, ctx: RenderContext) -> list[int]:
    """truncate_prompt_tokens: keep N tokens (-1: max_model_len), cutting the left end
    (the start of the prompt) unless truncation_side is right."""
    if plan.truncate is None:
        return ids
    check_truncation(plan.truncate, ctx.max_model_len)
    keep = ctx.max_model_len if plan.truncate == -1 else plan.truncate
    if len(ids) <= keep:
        return ids
    if keep == 0:
        raise RequestError("'truncate_prompt_tokens' 0 leaves no prompt.",
                           param="truncate_prompt_tokens")
    return ids[-keep:] if plan.truncation_side == "left" else ids[:keep]


def _mistral_ids(plan: PromptPlan, ctx: RenderContext) -> list[int]:
    """--tokenizer-mode mistral: mistral-common's encoding of the chat (gpu/tokenizers/mistral.py),
    as vLLM's; what it refuses is a 400 with its reason."""
    if plan.chat_template is not None:
        raise RequestError("This server renders chats with mistral-common (--tokenizer-mode "
                           "mistral); 'chat_template' does not apply.", param="chat_template")
    try:
        return ctx.tokenizer.encode_chat(plan.messages, plan.template_kwargs.get("tools"),
                                         continue_final_message=plan.continue_final_message)
    except ValueError as e:
        raise RequestError(str(e), param=plan.prompt_param) from None


_HARMONY_ROLES = ("system", "developer", "user", "assistant", "tool")


def _harmony_ids(plan: PromptPlan) -> list[int]:
    if plan.chat_template is not None:
        raise RequestError("This model's prompts are rendered in Harmony (gpt-oss); "
                           "'chat_template' does not apply.", param="chat_template")
    if plan.continue_final_message:
        raise RequestError("'continue_final_message' is not supported for Harmony (gpt-oss) "
                           "models.", param="continue_final_message")
    for i, m in enumerate(plan.messages):   # Harmony has no place for a custom role
        if m["role"] not in _HARMONY_ROLES:
            raise RequestError(f"'{plan.prompt_param}[{i}].role' {m['role']!r} has no place in "
                               f"the Harmony format; use one of {', '.join(_HARMONY_ROLES)}.",
                               param=f"{plan.prompt_param}[{i}].role")
    return harmony.render_ids(plan.messages, plan.template_kwargs,
                              add_generation_prompt=plan.add_generation_prompt)


def _apply_template(ctx: RenderContext, plan: PromptPlan) -> str:
    template = plan.chat_template or ctx.chat_template
    try:
        prompt = ctx.tokenizer.apply_chat_template(
            plan.messages, add_generation_prompt=plan.add_generation_prompt,
            **({"chat_template": template} if template else {}), **plan.template_kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise RequestError(f"Could not apply the chat template: {exc}",
                           param="chat_template" if plan.chat_template else plan.prompt_param
                           ) from exc
    if plan.continue_final_message:
        # The prompt ends where the last (assistant) message's text ends: whatever the
        # template adds after it (an end-of-turn token) is cut, so the model continues it.
        final = plan.messages[-1]["content"]
        if not isinstance(final, str):     # a picture's parts: the last text part
            final = next((p["text"] for p in reversed(final) if p.get("type") == "text"), "")
        end = prompt.rfind(final) if final else -1
        if end >= 0:
            prompt = prompt[:end + len(final)]
    return prompt


def _resolve_max_tokens(ctx: RenderContext, prompt_len: int, plan: PromptPlan) -> int:
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input.",
            param=plan.prompt_param, code="context_length_exceeded")
    room = limit - prompt_len
    requested = plan.max_tokens
    # As vLLM: --override-generation-config's max_new_tokens is a ceiling on every
    # request's max tokens, asked for or not; the model's (or a --generation-config
    # folder's) is only the default of a request that asks for none, where its API has no
    # default of its own (completions' is 16).
    ceiling = ctx.max_tokens_ceiling
    if type(ceiling) is int and ceiling > 0:
        room = min(room, ceiling)
        if requested is not None:
            requested = min(requested, ceiling)
    if requested is None:
        default = ctx.default_sampling.get("max_new_tokens")
        if plan.default_max_tokens is not None or not (type(default) is int and default > 0):
            default = room if plan.default_max_tokens is None else plan.default_max_tokens
        return min(default, room)
    if requested > room:
        where = "messages" if plan.prompt_param == "messages" else "prompt"
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{requested + prompt_len} tokens ({prompt_len} in the {where}, {requested} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            param=plan.max_tokens_param, code="context_length_exceeded")
    return requested


IMAGE_RENDERS = 8     # requests with pictures rendered at once (each in a worker thread)


async def run(receive, send, replies, ctx: RenderContext, log=None) -> None:
    """Render each submission; a bad one gets its error on its reply channel. A request
    with pictures renders in a worker thread (fetching, decoding, preprocessing) while the
    others go on."""
    import trio

    limiter = trio.CapacityLimiter(IMAGE_RENDERS)
    async with receive, send, trio.open_nursery() as nursery:
        async for sub in receive:
            if log is not None:   # pipeline.core.events redacts credentials from body and headers
                log("received", request_id=sub.request_id, api=sub.api, arrival=sub.arrival,
                    headers=sub.headers, body=sub.body)
            if ctx.vision is not None and has_images(sub.body):
                nursery.start_soon(_render_one, sub, send.clone(), replies, ctx, log, limiter)
                continue
            await _render_one(sub, None, replies, ctx, log, None, send)


async def _render_one(sub, own_send, replies, ctx, log, limiter, send=None) -> None:
    """One submission: rendered (in a worker thread under `limiter`, when given) and sent
    on, or its error on its reply channel. `own_send`: a clone of the channel, closed when
    done (a task of its own)."""
    import trio

    if own_send is not None:
        async with own_send:
            await _render_one(sub, None, replies, ctx, log, limiter, own_send)
        return
    try:
        req = (render(sub, ctx) if limiter is None else
               await trio.to_thread.run_sync(render, sub, ctx, limiter=limiter))
    except RequestError as err:
        if log is not None:
            log("rejected", request_id=sub.request_id, status=err.status, message=err.message)
        replies.send(sub.request_id, err)
        replies.release(sub.request_id)
        if ctx.kv_transfer is not None and (rp := refused_remote_prefill(sub.body)) is not None:
            notify_refused(rp)   # vLLM's rule: the prefill side frees now, not at its timeout
        return
    except Exception as exc:  # a bug must cost one request, not the server
        if log is not None:
            log("render_failed", request_id=sub.request_id, error=repr(exc))
        replies.send(sub.request_id, RequestError(
            f"Internal error while rendering the request: {exc}", status=500,
            type="server_error"))
        replies.release(sub.request_id)
        return
    if log is not None:
        log("rendered", request_id=req.request_id, api=req.api,
            prompt_tokens=len(req.prompt_token_ids), max_tokens=req.sampling.max_tokens)
    await send.send(req)
