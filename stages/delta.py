"""The one per-request delta that flows schedule -> detokenize -> parse -> account -> emit.

schedule creates a `Delta` for each request an engine step touched; each later stage
builds its own output delta once, with the constructor, from the one it received and
what it adds (`detokenized`: text and logprobs with text, and a stop string's finish;
`parsed`: content, reasoning, tool calls, and finish_reason tool_calls when the turn ends
in a call; `accounted`: usage where a reply reads it). A stage with nothing to add passes
the delta on as it came. What a stage must remember between steps lives in its own
per-choice state object (DetokState, ThinkState, _RequestUsage, a Framer), never in the
message. The deltas of one engine step travel together in one `Step`
(stages/messages.py), the message on every channel from schedule to emit.
"""
from __future__ import annotations

import enum
import attrs

from gpu.interface import TokenLogprobs


class FinishReason(enum.StrEnum):
    """Why a request stopped; the values are the API's finish_reason strings."""
    STOP = "stop"            # EOS, a stop token id, a stop string, or a complete grammar
    LENGTH = "length"        # max_tokens or max_model_len
    ABORT = "abort"          # the client went away (or the server is stopping)
    ERROR = "error"          # the engine failed while running the request's step
    TOOL_CALLS = "tool_calls"


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    # continuous usage stats of a request of several choices: this delta's choice's own
    # counts (what its chunks carry, as vLLM), beside the request's totals above
    choice: Usage | None = None
    # prompt tokens this request wrote into the prefix cache (vLLM's): its prompts' full
    # blocks past the ones it found there
    created_cache_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class RequestMetrics:
    """One request's timings (--enable-per-request-metrics), from its queued, first
    scheduled, first token and last token times and its N generated tokens."""
    queue_time_ms: float              # first scheduled - queued
    time_to_first_token_ms: float     # first token - first scheduled
    generation_time_ms: float         # last token - first token
    mean_itl_ms: float                # generation_time_ms / (N - 1)
    tokens_per_second: float          # N / (last token - first scheduled)


@attrs.frozen
class SpecRequestMetrics(RequestMetrics):
    """RequestMetrics of a request that verified drafts (--speculative-config): its own
    acceptance figures too (a request that never drafted gets plain RequestMetrics)."""
    spec_num_drafts: int = 0              # verify passes of its sequences with drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_length: float = 0.0   # tokens per verify pass: 1 + accepted / drafts


@attrs.frozen
class TokenLogprob:
    """One output token's logprob with its text, and the top alternatives with theirs."""
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class PromptLogprob:
    """One prompt token's logprob given the tokens before it (vLLM's prompt_logprobs): the
    token, its rank in the vocabulary, and the top alternatives (id, text, logprob; rank
    is their place, from 1)."""
    token_id: int
    token: str
    logprob: float | None          # None: the first prompt token (nothing before it)
    rank: int = 0
    top: tuple[tuple[int, str, float], ...] = ()


@attrs.frozen
class ToolCallDelta:
    """A tool call the parse stage completed: its place among the request's calls, its id
    (call_...), the function's name and its arguments (a JSON string)."""
    index: int
    id: str
    name: str
    arguments: str


@attrs.frozen(slots=False, init=False)
class Delta:
    """What one engine step produced for one request.

    Built up to twice per sequence per step (schedule's, and detokenize's with the text),
    so its constructor is on the host path of every token:
    - not slotted: a frozen class with a __dict__ is built by storing into that dict,
      where a slotted one pays an object.__setattr__ per field;
    - `__init__` written out (init=False): it is attrs' own for a frozen dict class less
      the object.__setattr__ that attrs binds first and never uses here (10% of a build);
      tests/stages/test_delta.py holds it to the fields, their order and defaults;
    - no field has a validator, a converter or a factory."""
    # -- schedule
    request_id: str
    token_ids: tuple[int, ...] = ()            # sampled this step (after a stop string: none)
    finish_reason: FinishReason | None = None  # None while running
    stop_reason: str | int | None = None       # the stop token id (schedule) or string (detokenize)
    num_cached_tokens: int = 0                 # prompt tokens served from the prefix cache
    error: str | None = None                   # finish_reason ERROR: what went wrong
    token_logprobs: tuple[TokenLogprobs, ...] = ()  # raw, one per token, when asked for
    scheduled_at: float = 0.0                  # time.monotonic() when first scheduled (0: never)
    index: int = 0                             # the choice (n > 1), each its own sequence
    # on a choice's first delta, with prompt_logprobs: one per prompt token (None first)
    prompt_token_logprobs: tuple[TokenLogprobs | None, ...] = ()
    # speculative decoding: drafts this step verified for the choice, and how many held
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # -- detokenize
    text: str = ""                             # new text
    logprobs: tuple[TokenLogprob, ...] = ()    # token_logprobs with their text
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # prompt_token_logprobs with their text
    # -- parse
    content: str = ""                          # new answer text
    reasoning: str = ""                        # new reasoning text (only with a reasoning parser)
    tool_calls: tuple[ToolCallDelta, ...] = ()  # calls completed this step (with a tool plan)
    reasoning_tokens: int = 0                  # of token_ids, those inside the reasoning
    reasoning_span: int = 0                    # of token_ids from the start, the reasoning's (tags too)
    # -- account
    # the totals so far, where a reply reads them: on each choice's last delta (the final
    # usage on the request's last) and on every delta of a stream with continuous usage
    # stats; None on the others (most deltas: building it for each is a step's cost)
    usage: Usage | None = None
    metrics: RequestMetrics | None = None      # the finished request's timings, when asked for
    # -- a pooling sequence's one delta (schedule, from StepResult.pooled): its vector,
    # float32 little-endian (gpu/worker/pooling_runner.py)
    pooled: bytes | None = None
    # -- the KV connector's reply params (issue 36): on a prefill instance's finishing delta
    # of a request with do_remote_decode, what the decode instance needs (vLLM's keys)
    kv_transfer_params: dict | None = None

    def __init__(self, request_id: str, token_ids: tuple[int, ...] = (),
                 finish_reason: FinishReason | None = None, stop_reason: str | int | None = None,
                 num_cached_tokens: int = 0, error: str | None = None,
                 token_logprobs: tuple[TokenLogprobs, ...] = (), scheduled_at: float = 0.0,
                 index: int = 0, prompt_token_logprobs: tuple[TokenLogprobs | None, ...] = (),
                 draft_tokens: int = 0, accepted_tokens: int = 0, text: str = "",
                 logprobs: tuple[TokenLogprob, ...] = (),
                 prompt_logprobs: tuple[PromptLogprob, ...] = (), content: str = "",
                 reasoning: str = "", tool_calls: tuple[ToolCallDelta, ...] = (),
                 reasoning_tokens: int = 0, reasoning_span: int = 0, usage: Usage | None = None,
                 metrics: RequestMetrics | None = None, pooled: bytes | None = None,
                 kv_transfer_params: dict | None = None) -> None:
        fields = self.__dict__     # frozen: __setattr__ raises, as attrs' own __init__ does this
        fields["request_id"] = request_id
        fields["token_ids"] = token_ids
        fields["finish_reason"] = finish_reason
        fields["stop_reason"] = stop_reason
        fields["num_cached_tokens"] = num_cached_tokens
        fields["error"] = error
        fields["token_logprobs"] = token_logprobs
        fields["scheduled_at"] = scheduled_at
        fields["index"] = index
        fields["prompt_token_logprobs"] = prompt_token_logprobs
        fields["draft_tokens"] = draft_tokens
        fields["accepted_tokens"] = accepted_tokens
        fields["text"] = text
        fields["logprobs"] = logprobs
        fields["prompt_logprobs"] = prompt_logprobs
        fields["content"] = content
        fields["reasoning"] = reasoning
        fields["tool_calls"] = tool_calls
        fields["reasoning_tokens"] = reasoning_tokens
        fields["reasoning_span"] = reasoning_span
        fields["usage"] = usage
        fields["metrics"] = metrics
        fields["pooled"] = pooled
        fields["kv_transfer_params"] = kv_transfer_params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def detokenized(self, text: str, logprobs: tuple[TokenLogprob, ...],
                    finish_reason: FinishReason | None, stop_reason: str | int | None,
                    token_ids: tuple[int, ...], token_logprobs: tuple[TokenLogprobs, ...],
                    prompt_logprobs: tuple[PromptLogprob, ...]) -> Delta:
        """detokenize's output: this delta with its text (content starts as the text, what
        a request without a parser shows), logprobs with text, a stop string's finish (the
        tokens after the stop string cut off)."""
        # Positional, in field order (a third faster than by keyword: this runs per token
        # of every request with logprobs or stop strings); tests/stages/test_delta.py
        # checks every builder carries each field it does not set.
        return Delta(self.request_id, token_ids, finish_reason, stop_reason,
                     self.num_cached_tokens, self.error, token_logprobs, self.scheduled_at,
                     self.index, self.prompt_token_logprobs, self.draft_tokens,
                     self.accepted_tokens, text, logprobs, prompt_logprobs, text,
                     self.reasoning, self.tool_calls, self.reasoning_tokens,
                     self.reasoning_span, self.usage, self.metrics, self.pooled,
                     self.kv_transfer_params)

    def running_text(self, text: str) -> Delta:
        """detokenized(text, ...) for a running delta of schedule's with nothing but its
        tokens, per-request fields and draft counts (no finish, logprobs, prompt logprobs
        or error): most deltas of most steps, so it passes 16 fields, not 22."""
        return Delta(self.request_id, self.token_ids, None, None, self.num_cached_tokens,
                     None, (), self.scheduled_at, self.index, (), self.draft_tokens,
                     self.accepted_tokens, text, (), (), text)

    def parsed(self, content: str, reasoning: str, tool_calls: tuple[ToolCallDelta, ...],
               finish_reason: FinishReason | None, reasoning_tokens: int,
               reasoning_span: int) -> Delta:
        """parse's output: this delta split into content, reasoning and tool calls."""
        return Delta(self.request_id, self.token_ids, finish_reason, self.stop_reason,
                     self.num_cached_tokens, self.error, self.token_logprobs,
                     self.scheduled_at, self.index, self.prompt_token_logprobs,
                     self.draft_tokens, self.accepted_tokens, self.text, self.logprobs,
                     self.prompt_logprobs, content, reasoning, tool_calls, reasoning_tokens,
                     reasoning_span, self.usage, self.metrics, self.pooled,
                     self.kv_transfer_params)

    def accounted(self, usage: Usage, metrics: RequestMetrics | None = None) -> Delta:
        """account's output: this delta with the usage so far (and the request's timings)."""
        return Delta(self.request_id, self.token_ids, self.finish_reason, self.stop_reason,
                     self.num_cached_tokens, self.error, self.token_logprobs,
                     self.scheduled_at, self.index, self.prompt_token_logprobs,
                     self.draft_tokens, self.accepted_tokens, self.text, self.logprobs,
                     self.prompt_logprobs, self.content, self.reasoning, self.tool_calls,
                     self.reasoning_tokens, self.reasoning_span, usage, metrics, self.pooled,
                     self.kv_transfer_params)
