"""The messages that cross stages, as plain frozen data (no torch, no callables): what web
hands to render (`Submission`), what render hands on (`RenderedRequest` with its
`SamplingParams`, `ToolPlan` and `ReplySpec`), the scheduler's control messages (`Abort`,
`FinishRequest`) and the one message on every channel from schedule to emit (`Step`, its
per-request `Delta`s in stages/delta.py). What the runner takes and returns is
gpu/interface.py.

This module sits below the protocol (stages/api/): it imports no API module, and each
API's plan builds the parts of a RenderedRequest that are its own (`ToolPlan`,
`ReplySpec`) from its typed request, which goes no further than render.
"""
from __future__ import annotations

from typing import Any

import attrs

from gpu.interface import Constraint, ImageInput, LoRARef, PoolingOptions, SamplingOptions
from stages.delta import Delta
from stages.kv_transfer import KVTransfer


@attrs.frozen
class Submission:
    """What web hands to render: the raw JSON body of one API call."""
    request_id: str
    api: str                      # "chat" | "completions" | "responses"
    body: dict
    arrival: float                # time.monotonic() at the HTTP layer
    headers: tuple[tuple[str, str], ...] = ()   # the HTTP request's (for the event log only)


@attrs.frozen
class SamplingParams:
    """What one request asks of generation: the sampler's options plus what the
    scheduler and detokenize need (max_tokens, EOS, stop strings)."""
    max_tokens: int
    options: SamplingOptions = SamplingOptions()   # the sampler's part, passed to the GPU as is
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    constraint: Constraint | None = None           # structured output (gpu/worker/grammar.py compiles it)
    prompt_logprobs: int | None = None             # the prompt tokens' logprobs (top k); None: off
    # use_beam_search: the beam width (the request's n; stages/schedule/beam.py); 0: off
    beam_width: int = 0
    length_penalty: float = 1.0                    # beam search's score: logprob / len ** this


@attrs.frozen
class ToolPlan:
    """How the parse stage finds a request's tool calls (stages/api/tools.py makes it)."""
    kind: str                    # "auto": the server's parser | "named" | "required"
    parser: str | None = None    # auto: the --tool-call-parser name
    name: str | None = None      # named: the function
    parallel: bool = True        # parallel_tool_calls: false keeps the first call only


@attrs.frozen
class ResponseEcho:
    """What a Response object repeats of its request (OpenAI's Response echoes these),
    with the defaults a Response shows for what the request left out."""
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    reasoning_summary: str | None = None
    tool_choice: Any = "auto"                 # as sent: a string or a JSON object
    tools: tuple[dict[str, Any], ...] = ()    # as sent
    user: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    # stateful Responses (web/responses_routes.py keeps them)
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    # enable_response_messages (vLLM's): the Response carries input_messages (the rendered
    # prompt, as render decoded its ids, and the ids) and output_messages (the model's
    # text and tokens); None: not asked
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] = ()


@attrs.frozen
class ReplySpec:
    """What a reply shows and echoes of its request beyond the generated text, decided once
    by the API's plan at render time (stages/api/<api>.py `reply_spec`). detokenize and the
    framers read it; nothing downstream sees the typed request."""
    return_token_ids: bool = False    # the token ids (and the prompt's) on the reply
    return_tokens_as_token_ids: bool = False   # logprobs name each token "token_id:N"
    include_reasoning: bool = True    # false: the reasoning is hidden
    # include_reasoning false with a parser on (reasoning or tools): no choice carries
    # logprobs or token ids, streamed or not (vLLM's hide_stream_metadata)
    hide_token_metadata: bool = False
    reasoning_details: bool = False   # a reasoning parser is on: completion_tokens_details
    response: ResponseEcho | None = None   # the Responses API's echo; None for the others
    prompt_tokens_details: bool = False    # --enable-prompt-tokens-details (render sets it)


@attrs.frozen
class PoolingReply:
    """What a pooling reply needs beyond the vectors (stages/api/pooling.py frames it)."""
    kind: str                            # embeddings | pooling | score | rerank | classify
    encoding_format: str = "float"
    # score and rerank: (sequence a, sequence b) per pair, or (sequence,) for a cross-encoder
    pairs: tuple[tuple[int, ...], ...] = ()
    documents: tuple[str, ...] = ()      # rerank with return_documents: each pair's document
    top_n: int = 0                       # rerank: 0 keeps every result
    labels: tuple[str, ...] = ()         # classify: the model's labels


@attrs.frozen
class PoolingWork:
    """A pooling request's own part (issue 32): each of its prompts is one sequence,
    pooled whole in one step; what each asks of the runner, and what the reply needs."""
    options: PoolingOptions
    reply: PoolingReply
    segments: tuple[int, ...] = ()       # per sequence: a cross-encoder pair's second text

    def options_of(self, index: int) -> PoolingOptions:
        segment = self.segments[index] if self.segments else 0
        return attrs.evolve(self.options, segment=segment) if segment else self.options


@attrs.frozen
class RenderedRequest:
    request_id: str
    api: str                      # "chat" | "completions" | "responses"
    model: str                    # the served model name echoed back
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool           # stream_options.include_usage (always usage when not streaming)
    created: int                  # unix seconds
    arrival: float
    reply: ReplySpec              # what the reply shows and echoes of the request
    continuous_usage: bool = False  # streaming: every chunk carries the usage so far
    cache_salt: str | None = None   # prefix-cache blocks are shared only with the same salt
    per_request_metrics: bool = False   # the reply carries the request's own timings
    n: int = 1                      # choices: n sequences sampled from one prompt
    tools: ToolPlan | None = None   # how parse finds tool calls (stages/api/tools.py)
    # Several prompts in one request (a completions prompt list): prompt_token_ids is the
    # first. Prompt i's choice j is choice i * n + j, a sequence of its own.
    prompts: tuple[tuple[int, ...], ...] = ()
    prompt_max_tokens: tuple[int, ...] = ()   # with several prompts: each one's max_tokens
    echo: tuple[str, ...] | None = None      # echo: the text each prompt's choices start with
    pooling: PoolingWork | None = None       # a pooling request: its prompts are its inputs
    priority: int = 0        # --scheduling-policy priority: lower runs first (stages/schedule/priority.py)
    images: tuple[ImageInput, ...] = ()      # the prompt's pictures, in order (issue 34)
    lora: LoRARef | None = None              # the LoRA adapter `model` named (issue 33); None: base
    # kv_transfer_params (issue 36): hold the prompt's blocks for a decode instance, or
    # start from a remote prefill's (stages/kv_transfer.py); None: neither
    kv_transfer: KVTransfer | None = None

    @property
    def num_choices(self) -> int:
        """Sequences of the request: n per prompt."""
        return self.n * len(self.prompts) if self.prompts else self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts)) if self.prompts else len(self.prompt_token_ids)

    def prompt_of(self, index: int) -> tuple[int, ...]:
        """The prompt of choice `index`."""
        return self.prompts[index // self.n] if self.prompts else self.prompt_token_ids

    def max_tokens_of(self, index: int) -> int:
        return (self.prompt_max_tokens[index // self.n] if self.prompt_max_tokens
                else self.sampling.max_tokens)



@attrs.frozen
class Step:
    """One engine step, schedule -> detokenize -> parse -> account -> emit: the requests
    admitted since the last step and a delta for every request the step touched. Each
    stage passes it on with its own deltas (`with_deltas`)."""
    step: int
    new_requests: tuple[RenderedRequest, ...] = ()
    deltas: tuple[Delta, ...] = ()
    # -- schedule's queue sizes after the step (for the event log)
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    done_at: float = 0.0      # time.monotonic() when the step's tokens came back
    engine: int = 0           # data parallel: the rank of the engine that ran it

    def with_deltas(self, deltas: tuple[Delta, ...]) -> Step:
        """This step with a stage's deltas in place of the ones it came with (the
        constructor, not attrs.evolve, whose introspection costs 3x: once per stage per
        step)."""
        return Step(self.step, self.new_requests, deltas, self.num_running, self.num_waiting,
                    self.kv_blocks_used, self.done_at, self.engine)


# -- the scheduler's inbox: admitted requests arrive with control messages ---------------
@attrs.frozen
class Abort:
    """The client went away: drop the request. With an ``error`` (the server is shutting
    down while the client still reads) the request finishes with FinishReason.ERROR, so its
    reply ends with that error instead of nothing."""
    request_id: str
    error: str | None = None


@attrs.frozen
class FinishRequest:
    """detokenize matched a stop string in one choice: stop generating it, free its blocks."""
    request_id: str
    index: int = 0


@attrs.frozen
class KVRelease:
    """The KV connector (issue 36, the prefill side): the decode instance has read these
    held requests' blocks (NIXL's notification) or will not (its side-channel free), so
    free them; `expire` also frees those held past VLLM_NIXL_ABORT_REQUEST_TIMEOUT."""
    request_ids: tuple[str, ...] = ()
    expire: bool = False


@attrs.frozen(eq=False)
class Control:
    """An operation on the engine core from the HTTP edge (issue 37), answered through
    `answer` (called on the schedule stage's trio task, once):
    - "reset_prefix_cache": drop every cached prefix block (`reset_running`: preempt the
      running sequences first); answers whether it was reset.
    - "sleep" (`level` 1 or 2) and "wake_up": once no request runs, the runner drops (and
      gets back) its KV cache, and at level 2 its weights; answers None or an error string.
    In-process only: the answer is a callable (the one-process Engine holds it)."""
    op: str
    answer: Any
    level: int = 1
    reset_running: bool = False
