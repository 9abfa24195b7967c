"""POST /v1/completions: the request's prompt plan, and the reply's framing."""
from __future__ import annotations

from stages.api.chat import MAX_LOGPROBS, check_n
from stages.api.framing import (DONE, ChoiceState, ChunkBytes, Framer, error_bytes, json_body,
                                sse_data, usage_info)
from stages.api.protocol import (Completion, CompletionChoice, CompletionLogprobs,
                                 CompletionRequest, PromptPlan, RequestError, server_error)
from stages.api.structured import constraint_of
from stages.delta import Delta, FinishReason

# OpenAI's default for /v1/completions.
DEFAULT_MAX_TOKENS = 16


def plan(req: CompletionRequest, *, reasoning_parser: bool, tools=None) -> PromptPlan:
    check_n(req.n)
    if req.best_of not in (None, req.n):
        raise RequestError("'best_of' other than n is not supported (no ranking of extra "
                           "choices).", param="best_of")
    if req.echo:
        raise RequestError("'echo' is not supported by this server yet.", param="echo")
    if req.suffix:
        raise RequestError("'suffix' is not supported by this server yet.", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got "
                           f"{req.logprobs}.", param="logprobs")
    if req.stream_options is not None and not req.stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true.",
                           param="stream_options")
    text, ids = _prompt(req.prompt)
    return PromptPlan(
        text=text, token_ids=ids,
        add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens,
        prompt_param="prompt", max_tokens=req.max_tokens, max_tokens_param="max_tokens",
        truncate=req.truncate_prompt_tokens, truncation_side=req.truncation_side or "left",
        default_max_tokens=DEFAULT_MAX_TOKENS, logprobs=req.logprobs, stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage)
        if req.stream else True,
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        constraint=constraint_of(req))


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _prompt(prompt: object) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]          # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if _is_token_ids(prompt):
        if not prompt:
            raise RequestError("'prompt' must not be empty.", param="prompt")
        return None, tuple(prompt)
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("'prompt' holds more than one prompt; batched prompts are not "
                           "supported, send one request per prompt.", param="prompt")
    raise RequestError("'prompt' must be a string or an array of token ids.", param="prompt")


# -- the reply -----------------------------------------------------------------------------

class CompletionFramer(Framer):
    def __init__(self, req) -> None:
        super().__init__(req)
        self.id = f"cmpl-{req.request_id}"
        self._choices = [ChoiceState() for _ in range(req.n)]
        self._wants_logprobs = req.sampling.options.logprobs is not None
        self._offsets = [0] * req.n        # text_offset of each choice's next token
        self._return_ids = req.request.return_token_ids
        self._prompt_sent = [False] * req.n
        self._chunk = ChunkBytes(Completion(
            id=self.id, created=req.created, model=req.model, choices=[],
            **({"usage": None} if req.include_usage else {})),
            continuous_usage=req.continuous_usage)

    def _logprobs_json(self, index: int, entries) -> CompletionLogprobs:
        offsets = []
        for e in entries:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(e.token)
        return CompletionLogprobs(tokens=[e.token for e in entries],
                                  token_logprobs=[e.logprob for e in entries],
                                  top_logprobs=[dict(e.top) for e in entries],
                                  text_offset=offsets)

    def _stream(self, delta: Delta) -> bytes:
        # Completions have no reasoning field: a reasoning parser's reasoning is dropped.
        out = []
        lp = (self._logprobs_json(delta.index, delta.logprobs)
              if self._wants_logprobs and delta.logprobs else None)
        ids = self._ids(delta) if self._return_ids and delta.token_ids else {}
        usage = usage_info(delta.usage) if self.req.continuous_usage else None
        if delta.content or lp or ids:
            out.append(self._chunk([CompletionChoice(index=delta.index, text=delta.content,
                                                     logprobs=lp, **ids)], usage))
        reason = delta.finish_reason
        if reason is FinishReason.ERROR:
            out += [sse_data(server_error(delta.error)), DONE]
        elif reason is not None:
            out.append(self._chunk([CompletionChoice(index=delta.index, text="",
                                                     finish_reason=reason,
                                                     stop_reason=delta.stop_reason)], usage))
            if self.closing:
                if self.req.include_usage:
                    out.append(self._chunk.with_usage(usage_info(delta.usage), delta.metrics))
                out.append(DONE)
        return b"".join(out)

    def _ids(self, delta: Delta) -> dict:
        """return_token_ids on a streamed choice: its tokens, and the prompt's on its first."""
        ids = {"token_ids": list(delta.token_ids)}
        if not self._prompt_sent[delta.index]:
            self._prompt_sent[delta.index] = True
            ids["prompt_token_ids"] = list(self.req.prompt_token_ids)
        return ids

    def _accumulate(self, delta: Delta) -> bytes:
        c = self._choices[delta.index]
        c.text.append(delta.content)
        c.logprobs.extend(delta.logprobs)
        c.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        if not self.closing:
            return b""
        if delta.finish_reason is FinishReason.ERROR:
            self.status = 500
            return error_bytes(delta)
        return json_body(Completion(
            id=self.id, created=self.req.created, model=self.req.model,
            choices=[CompletionChoice(
                index=i, text="".join(c.text), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=self._logprobs_json(i, c.logprobs) if self._wants_logprobs else None,
                **({"prompt_token_ids": list(self.req.prompt_token_ids),
                    "token_ids": c.token_ids} if self._return_ids else {}))
                for i, c in enumerate(self._choices)],
            usage=usage_info(delta.usage),
            **({} if delta.metrics is None else {"metrics": delta.metrics})))
