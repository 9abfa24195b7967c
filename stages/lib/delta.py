"""The one per-request delta that flows schedule -> detokenize -> parse -> account -> emit.

schedule creates a `Delta` for each request an engine step touched; each later stage
fills in only its own fields through a `Delta.evolver` (detokenize: text and logprobs with
text, and a stop string's finish; parse: content, reasoning, tool calls, and finish_reason
tool_calls when the turn ends in a call; account: usage where a reply reads it).
Nothing is repacked by position. The deltas of one engine step travel together in one
`Step` (stages/schedule.py), the message on every channel from schedule to emit.
"""
from __future__ import annotations

import enum
from typing import Callable

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


@attrs.frozen(slots=False)
class Delta:
    """What one engine step produced for one request.

    Not slotted: every stage makes a new Delta for every sequence of every step, and a
    frozen class with a __dict__ is built by one dict copy (see `evolver`) instead of an
    object.__setattr__ per field."""
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def evolver(*names: str) -> Callable[..., Delta]:
        """`evolver("text", "logprobs")` is `lambda d, text, logprobs: attrs.evolve(d,
        text=text, logprobs=logprobs)`, compiled: every stage evolves every delta of every
        step, and attrs.evolve's per-call introspection is most of that cost."""
        unknown = set(names) - set(_DELTA_FIELDS)
        if unknown:
            raise AttributeError(f"Delta has no field {sorted(unknown)[0]!r}")
        # The fields have no validators or converters, so a copy of d's attributes with
        # the new values is exactly what Delta(...) would build.
        sets = "".join(f"    new[{n!r}] = {n}\n" for n in names)
        namespace = {"Delta": Delta, "_new": object.__new__}
        exec(f"def evolve(d, {', '.join(names)}):\n"
             f"    out = _new(Delta)\n    new = out.__dict__\n    new.update(d.__dict__)\n"
             f"{sets}    return out\n", namespace)
        return namespace["evolve"]


_DELTA_FIELDS = tuple(a.name for a in attrs.fields(Delta))
