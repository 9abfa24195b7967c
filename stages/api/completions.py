"""POST /v1/completions: the request's prompt plan, and the reply's framing."""
from __future__ import annotations

from typing import Any, ClassVar

import attrs

from stages.api.chat import MAX_CHOICES, check_n, check_prompt_logprobs, logprob_token_ids
from stages.api.common import ABSENT, Invalid, PromptPlan, RequestError, omit_absent, opt, reply
from stages.api.framing import (MIN_LOGPROB, ChoicesFramer, ChoiceState, UsageInfo,
                                prompt_logprobs_json)
from stages.api.request_types import ROUTER_EXTRAS, VLLM_EXTRAS, ChoiceRequest
from stages.api.structured import constraint_of
from stages.delta import Delta, PromptLogprob
from stages.messages import ReplySpec

@attrs.frozen
class CompletionRequest(ChoiceRequest):
    prompt: Any = opt()           # a string, token ids, or several of either
    logprobs: int | None = opt()
    suffix: str | None = opt()
    best_of: int | None = opt()
    _not_implemented: ClassVar[dict[str, Any]] = {**VLLM_EXTRAS, **ROUTER_EXTRAS}

    @prompt.validator
    def _prompt(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)


# -- replies ----------------------------------------------------------------------------

@reply
class CompletionLogprobs:
    """The legacy completions shape: parallel lists, alternatives as {token: logprob}."""
    tokens: list[str]
    token_logprobs: list[float | None]          # echo: null for the prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@omit_absent
@reply
class CompletionChoice:
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = ABSENT      # streaming: on the final chunk only
    prompt_logprobs: list[Any] | None = ABSENT  # prompt_logprobs (vLLM's shape)
    prompt_token_ids: list[int] | None = ABSENT  # return_token_ids (streaming: first chunk)
    token_ids: list[int] | None = ABSENT        # return_token_ids


@omit_absent
@reply
class Completion:
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = ABSENT
    metrics: Any = ABSENT                       # --enable-per-request-metrics
    kv_transfer_params: Any = ABSENT            # a prefill instance's, for the decode side


# OpenAI's default for /v1/completions.
DEFAULT_MAX_TOKENS = 16


def plan(req: CompletionRequest, *, reasoning_parser: bool, tools=None) -> PromptPlan:
    check_n(req.n)
    if req.best_of not in (None, req.n):
        raise RequestError("'best_of' other than n is not supported (no ranking of extra "
                           "choices).", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("'max_tokens' must be at least 1 (0 only with echo, which then "
                           "returns the prompt alone).", param="max_tokens")
    if req.suffix:
        raise RequestError("'suffix' is not supported by this server yet.", param="suffix")
    if req.logprobs is not None and req.logprobs < -1:   # render holds k to --max-logprobs
        raise RequestError(f"'logprobs' must be a non-negative integer, or -1 for the whole "
                           f"vocabulary; got {req.logprobs}.", param="logprobs")
    if req.stream_options is not None and not req.stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true.",
                           param="stream_options")
    batch = _prompts(req.prompt)
    if len(batch) * req.n > MAX_CHOICES:
        raise RequestError(f"'prompt' holds {len(batch)} prompts of n={req.n} choices each: "
                           f"at most {MAX_CHOICES} choices in all per request.", param="prompt")
    text, ids = (batch[0], None) if isinstance(batch[0], str) else (None, batch[0])
    check_prompt_logprobs(req.prompt_logprobs, req.stream)
    prompt_logprobs = None if req.stream else req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs     # echo with logprobs: the prompt's too, as vLLM
    return PromptPlan(
        text=text, token_ids=ids, batch=tuple(batch) if len(batch) > 1 else None,
        echo_prompt=req.echo, prompt_logprobs=prompt_logprobs,
        add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens,
        prompt_param="prompt", max_tokens=req.max_tokens, max_tokens_param="max_tokens",
        truncate=req.truncate_prompt_tokens, truncation_side=req.truncation_side or "left",
        default_max_tokens=DEFAULT_MAX_TOKENS,
        logprobs=0 if req.logprob_token_ids else req.logprobs,
        logprob_token_ids=logprob_token_ids(req.logprob_token_ids, req.logprobs is not None,
                                            "'logprobs' must be set"),
        stream=req.stream,
        stream_options=req.stream_options,
        constraint=constraint_of(req), reply=reply_spec(req))


def reply_spec(req: CompletionRequest) -> ReplySpec:
    """What the completion shows of the request: token ids, tokens named by id."""
    return ReplySpec(return_token_ids=req.return_token_ids,
                     return_tokens_as_token_ids=req.return_tokens_as_token_ids)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _prompts(prompt: object) -> list[str | tuple[int, ...]]:
    """The request's prompts: a string or a list of token ids is one; a list of strings or
    of token-id lists is several (as vLLM, one request each, answered together)."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_token_ids(prompt):
        if not prompt:
            raise RequestError("'prompt' must not be empty.", param="prompt")
        return [tuple(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_ids(p) for p in prompt):
            for i, p in enumerate(prompt):
                if not p:
                    raise RequestError(f"'prompt[{i}]' must not be empty.", param=f"prompt[{i}]")
            return [tuple(p) for p in prompt]
    raise RequestError("'prompt' must be a string, an array of token ids, or an array of "
                       "either (several prompts).", param="prompt")


# -- the reply -----------------------------------------------------------------------------

class CompletionFramer(ChoicesFramer):
    """Choice i * n + j is prompt i's choice j (vLLM's order). With echo each choice starts
    with its prompt: text, and (with logprobs) the prompt tokens' logprobs, the first null."""

    chunk_type = Completion
    body_type = Completion

    def __init__(self, req) -> None:
        super().__init__(req, f"cmpl-{req.request_id}")
        num = req.num_choices
        self._choices = [ChoiceState() for _ in range(num)]
        self._wants_logprobs = req.sampling.options.logprobs is not None
        self._offsets = [0] * num          # text_offset of each choice's next token
        self._return_ids = req.reply.return_token_ids
        self._ids_as_tokens = req.reply.return_tokens_as_token_ids
        self._prompt_sent = [False] * num
        self._echoed = [False] * num
        # each prompt's logprobs (its first choice brings them), as a choice shows them
        self._prompt_logprobs: list[tuple | None] = [None] * (num // req.n)
        self._show_prompt_logprobs = req.sampling.prompt_logprobs is not None
        # no echo, token ids or usage per chunk: a running choice's chunk is its text
        self._plain_stream = not (req.echo is not None or self._return_ids or req.continuous_usage)

    def _logprobs_json(self, index: int, entries) -> CompletionLogprobs:
        offsets, tokens, values, tops = [], [], [], []
        for e in entries:
            if isinstance(e, PromptLogprob) and self._ids_as_tokens:   # echo's prompt tokens
                e = _named_by_id(e)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(e.token)
            tokens.append(e.token)
            if isinstance(e, PromptLogprob):
                values.append(None if e.logprob is None else max(e.logprob, MIN_LOGPROB))
                tops.append(None if e.logprob is None else _prompt_top(e))
            else:
                values.append(e.logprob)
                tops.append(_sampled_top(e))
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                                  text_offset=offsets)

    def _prompt_part(self, delta: Delta) -> tuple[str, tuple]:
        """A choice's first delta under echo: the prompt's text and logprob entries to put
        before the delta's own."""
        i = delta.index
        if delta.prompt_logprobs:
            self._prompt_logprobs[i // self.req.n] = delta.prompt_logprobs
        if self.req.echo is None or self._echoed[i]:
            return "", ()
        self._echoed[i] = True
        lps = self._prompt_logprobs[i // self.req.n] or () if self._wants_logprobs else ()
        return self.req.echo[i // self.req.n], lps

    def _stream(self, delta: Delta) -> bytes:
        # Completions have no reasoning field: a reasoning parser's reasoning is dropped.
        if (self._plain_stream and delta.finish_reason is None and not delta.prompt_logprobs
                and not (self._wants_logprobs and delta.logprobs)):
            # a running choice's new text alone (what the general path below makes of it)
            return (self._chunk.text(delta.index, delta.content, _text_choice)
                    if delta.content else b"")
        out = []
        echo_text, echo_lps = self._prompt_part(delta)
        text = echo_text + delta.content
        lp = (self._logprobs_json(delta.index, echo_lps + delta.logprobs)
              if self._wants_logprobs and (delta.logprobs or echo_lps) else None)
        ids = self._ids(delta) if self._return_ids and delta.token_ids else {}
        usage = self._chunk_usage(delta)
        if text or lp or ids:
            out.append(self._chunk([CompletionChoice(index=delta.index, text=text,
                                                     logprobs=lp, **ids)], usage))
        out += self._stream_end(delta, usage)
        return b"".join(out)

    def _finish_choice(self, delta: Delta) -> CompletionChoice:
        return CompletionChoice(index=delta.index, text="", finish_reason=delta.finish_reason,
                                stop_reason=delta.stop_reason)

    def _ids(self, delta: Delta) -> dict:
        """return_token_ids on a streamed choice: its tokens, and its prompt's on its first."""
        ids = {"token_ids": list(delta.token_ids)}
        if not self._prompt_sent[delta.index]:
            self._prompt_sent[delta.index] = True
            ids["prompt_token_ids"] = list(self.req.prompt_of(delta.index))
        return ids

    def _accumulate(self, delta: Delta) -> bytes:
        c = self._choices[delta.index]
        if self.req.echo is None and not delta.prompt_logprobs:   # nothing before its own
            c.text.append(delta.content)
            if delta.logprobs:
                c.logprobs.extend(delta.logprobs)
        else:
            echo_text, echo_lps = self._prompt_part(delta)
            c.text.append(echo_text + delta.content)
            c.logprobs.extend(echo_lps + delta.logprobs)
        if self._return_ids:
            c.token_ids.extend(delta.token_ids)
        return self._body_end(delta)

    def _body_choice(self, i: int, c: ChoiceState) -> CompletionChoice:
        # vLLM's body has these keys, null when not asked for (a stream leaves them out)
        extra = {"prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}
        if self._show_prompt_logprobs:
            extra["prompt_logprobs"] = prompt_logprobs_json(self._prompt_logprobs[i // self.req.n] or ())
        if self._return_ids:
            extra.update(prompt_token_ids=list(self.req.prompt_of(i)), token_ids=c.token_ids)
        return CompletionChoice(
            index=i, text="".join(c.text), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=self._logprobs_json(i, c.logprobs) if self._wants_logprobs else None,
            **extra)


def _text_choice(index: int, text: str) -> CompletionChoice:
    return CompletionChoice(index=index, text=text, logprobs=None)


def _named_by_id(e: PromptLogprob) -> PromptLogprob:
    """return_tokens_as_token_ids: a prompt token and its alternatives as "token_id:N"
    (detokenize names the generated ones so)."""
    return attrs.evolve(e, token=f"token_id:{e.token_id}",
                        top=tuple((i, f"token_id:{i}", lp) for i, _, lp in e.top))


def _sampled_top(e) -> dict[str, float]:
    """A generated token's top_logprobs in the legacy shape: the sampled token, then the
    top alternatives (as vLLM and OpenAI: `logprobs: 0` still names the sampled token)."""
    top = {e.token: e.logprob}
    for text, lp in e.top:
        top.setdefault(text, lp)
    return top


def _prompt_top(e: PromptLogprob) -> dict[str, float]:
    """A prompt token's top_logprobs in the legacy shape: the token itself, then the top
    alternatives (as vLLM)."""
    top = {e.token: max(e.logprob, MIN_LOGPROB)}
    for _, text, lp in e.top:
        top.setdefault(text, max(lp, MIN_LOGPROB))
    return top
