"""What the runner takes and returns, as plain data: no torch, no trio.

The scheduler builds a `StepPlan` (chunks of token ids on block tables, the new
sequences' `SeqStart`), a runner executes it and answers a `StepResult` (token ids and
logprobs as tuples of Python numbers). `SamplingOptions` and `Constraint` are what a
request asks of the sampler and of constrained decoding; render builds them, so they
live here rather than beside the torch code that applies them (gpu/worker/sampler.py,
gpu/worker/grammar.py). `Runner` is the interface ModelRunner and the simulated runner share;
`ConstraintCompiler` the one the scheduler sees of gpu/worker/grammar.py's compiler.
"""
from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import attrs

# A token the scheduler does not know yet when it plans a step (async scheduling: step
# N+1 is planned while step N runs): the sequence's last sampled token, which the runner
# has and fills in. Only ever a chunk's last token.
PLACEHOLDER = -1

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@attrs.frozen
class SamplingOptions:
    temperature: float = 1.0        # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                  # <= 0: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0               # stop_token_ids are masked until this many outputs
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None       # None: off; k: the sampled token's logprob and the top k
    # logprob_token_ids (with logprobs 0): the alternatives are the sampled token, then these
    # ids (vLLM's order), in place of the top k
    logprob_token_ids: tuple[int, ...] = ()
    # logit controls (apply_logit_controls): ids already checked against the vocabulary
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token, bias in [-100, 100]) added
    allowed_token_ids: tuple[int, ...] = ()          # non-empty: every other token is banned
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # token sequences never completed
    # reasoning tokens allowed before </think> is forced (SeqStart.think names the tags); None: any
    thinking_token_budget: int | None = None

    @property
    def controls_logits(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@attrs.frozen
class Constraint:
    """What the output must match (a JSON schema, any JSON object, a regex, a choice of
    strings, an EBNF grammar or a structural tag), in one internal form whatever the API
    spelled it as. `spec` is a string (a JSON schema or structural tag as JSON text, a
    regex, an EBNF grammar, or a JSON array of choices), so that a constraint is hashable
    and its own cache key (gpu/worker/grammar.py compiles it)."""
    kind: str = attrs.field(validator=attrs.validators.in_(CONSTRAINT_KINDS))
    spec: str = ""
    compact: bool = False   # JSON without free whitespace (vLLM's disable_any_whitespace)
    # The request field it came from, for a 400 naming it (admit checks the constraint:
    # stages/admit.py). Not part of its identity: equal constraints share a compiled grammar.
    param: str = attrs.field(default="", eq=False)

    @staticmethod
    def choice(options: list[str]) -> Constraint:
        return Constraint("choice", json.dumps(list(options)))


@attrs.frozen
class PoolingOptions:
    """What one pooling sequence (an embedding, a classification, one text of a score) asks
    of the runner, beside the model's own PoolingSpec (gpu/config/pooling.py). None: the
    model's default."""
    dimensions: int | None = None     # Matryoshka: the first N values, cut before normalizing
    normalize: bool | None = None     # embeddings: L2-normalize
    use_activation: bool | None = None   # classifiers: sigmoid (one label) or softmax
    segment: int = 0                  # token type 1 from this position on (a cross-encoder's
                                      # second text); 0: one text


class TPLost(RuntimeError):
    """The tensor-parallel ranks can no longer step together: a worker rank has gone, or a
    step failed between its broadcast and its last collective (the other ranks are left
    inside one). The engine must stop (stages/gpu_step.py counts it as a lost device)."""


@attrs.frozen
class LoRARef:
    """The LoRA adapter a request runs with (issue 33): its served name, the id it got when it
    was loaded (unique for the server's life: a reload under the same name gets a new one, so
    neither the prefix cache nor the runner's loaded weights mix the two), and its folder
    (PEFT's adapter_config.json + adapter_model.safetensors), which the runner loads from."""
    name: str
    id: int
    path: str


class GrammarError(ValueError):
    """The constraint is not a valid schema, regex or grammar (the client's fault)."""


@attrs.frozen
class ImageInput:
    """One picture of a prompt (issue 34): its placeholder tokens are prompt positions
    offset .. offset + length - 1, its features come from the vision tower run on `pixels`
    (a float32 numpy array [3, H, W], made in render; Qwen2.5-VL's: below), and `hash`
    names its content (the runner's encoder cache and the prefix cache key on it)."""
    offset: int
    length: int
    hash: str
    pixels: object = attrs.field(eq=False, repr=False)
    # Qwen2.5-VL: the picture's patch grid (t, h, w), `pixels` its flattened patches
    # [t*h*w, C*T*P*P]; its M-RoPE positions follow from it (gpu/models/qwen_vision.py)
    grid: tuple[int, int, int] | None = None


@attrs.frozen
class SeqStart:
    """Registers a sequence's sampling state with the runner (sent once, on first schedule).

    `grammar` is the compiled grammar (an xgrammar CompiledGrammar) the scheduler waited
    for: the one field that is not plain data, since the scheduler and the runner share a
    process and compiling it again in the runner would cost the step."""
    seq_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    grammar: object = attrs.field(default=None, eq=False)   # compiled, if constrained
    think: tuple[int, int] | None = None   # reasoning's (open, close) ids: constrain after it
    thinking: bool = False                 # the prompt leaves the reasoning open
    prompt_logprobs: int | None = None     # the prompt tokens' logprobs (top k); None: off
    pooling: PoolingOptions | None = None  # a pooling sequence (prefill only, never split)
    images: tuple[ImageInput, ...] = ()    # the prompt's pictures (a vision-language model)
    lora: LoRARef | None = None            # the LoRA adapter its rows run with; None: the base


@attrs.frozen
class SeqChunk:
    """Tokens of one sequence to compute this step."""
    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int                    # tokens of this sequence already in the KV cache
    block_table: tuple[int, ...]      # covers start_pos + len(token_ids) tokens
    sample: bool                      # sample after this chunk (decode, or a prefill's last chunk)
    # speculative decoding: the chunk's last num_drafts tokens are drafts to verify; its
    # last 1 + num_drafts rows are sampled, and the drafts kept while each equals the
    # token sampled before it (StepResult.num_tokens says how many tokens came out)
    num_drafts: int = 0
    # speculative decoding with async scheduling (n-gram): planned while a step for the
    # sequence still ran, so its tokens are DRAFTs the runner fills (the sequence's last
    # sampled token, then up to num_drafts from prompt lookup: StepResult.num_drafts says
    # how many) and start_pos assumes that step kept every draft; the runner computes it
    # where the sequence's KV really ends (gpu/worker/staging.py float_chunks)
    floating: bool = False
    # a hybrid model's state slot (stages/schedule/state_slots.py): the sequence's
    # linear-attention states, continued from there unless start_pos is 0; -1: none
    state_slot: int = -1
    # a prefix-cache hit's snapshot slot, copied into state_slot before the forward; and
    # the snapshot slot that state_slot is copied into after it (-1: none)
    state_load: int = -1
    state_save: int = -1


@attrs.frozen
class KVRead:
    """A remote prefill (issue 36, the decode side): read blocks `block_ids` of engine
    `engine_id`'s KV cache (its side channel at host:port says where they are) into this
    cache's `local_block_ids`, every layer's K and V; NIXL tells the owner `request_id` when
    the read has landed, and it frees them."""
    seq_id: str
    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    local_block_ids: tuple[int, ...]


@attrs.frozen
class StepPlan:
    step: int
    chunks: tuple[SeqChunk, ...]
    new_seqs: tuple[SeqStart, ...] = ()
    released: tuple[str, ...] = ()     # sequences finished or aborted: drop their state
    # hybrid KV cache: (block, sliding slot or -1) changes, applied before the step (KVCache.remap)
    kv_updates: tuple[tuple[int, int], ...] = ()
    # the KV connector (issue 36): remote prefills to start reading before the step, and
    # whether reads are in flight (the runner reports those that landed or failed)
    kv_reads: tuple[KVRead, ...] = ()
    kv_waiting: bool = False


@attrs.frozen
class TokenLogprobs:
    """The sampled token's log-probability and the top-k alternatives (raw model output)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0                      # prompt logprobs: the token's rank in the vocabulary (from 1)


@attrs.frozen
class PromptLogprobs:
    """A prefill chunk's prompt logprobs for one sequence: the logprob of each prompt token
    it covered given the tokens before it (positions from 1 on, in order, each once)."""
    seq_id: str
    entries: tuple[TokenLogprobs, ...]


@attrs.frozen
class StepResult:
    step: int
    seq_ids: tuple[str, ...]           # the chunks that sampled, in plan order
    token_ids: tuple[int, ...]         # the sampled tokens, flat: num_tokens[i] for seq_ids[i]
    duration_s: float
    error: str | None = None           # the step failed: every sequence in the plan is lost
    logprobs: tuple[TokenLogprobs | None, ...] = ()   # per token of token_ids, when any asked
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # for the sequences that asked
    # tokens each sampled sequence got (accepted drafts + 1); empty: one each (no drafts)
    num_tokens: tuple[int, ...] = ()
    # with floating chunks: the drafts each sampled sequence verified (the runner's lookup
    # may find fewer than planned); empty: as planned
    num_drafts: tuple[int, ...] = ()
    # a pooling runner's output per sequence of seq_ids: float32 little-endian vectors
    pooled: tuple[bytes, ...] = ()
    # the KV connector: remote prefills whose blocks have landed, and those that failed
    kv_loaded: tuple[str, ...] = ()
    kv_failed: tuple[tuple[str, str], ...] = ()
    # of kv_failed: reads that timed out with NIXL still holding them (a late landing would
    # write into their blocks): the blocks stay held until a kv_loaded or kv_failed names
    # the read again
    kv_late: tuple[str, ...] = ()


@runtime_checkable
class ConstraintCompiler(Protocol):
    """Compiles a request's Constraint against the model's vocabulary off the engine's step
    path (gpu/worker/grammar.py GrammarCompiler: xgrammar, in a worker thread). The scheduler keeps
    the request waiting until the future is done; its result goes to the runner in
    SeqStart.grammar, its exception fails the request."""

    def submit(self, constraint: Constraint) -> Future:
        """The compiled grammar's future (already done on a cache hit)."""
        ...


@runtime_checkable
class Runner(Protocol):
    """Executes one plan at a time, in plan order, on one thread."""

    def execute(self, plan: StepPlan, staged: object = None) -> StepResult:
        """Run one step; `staged` is `stage(plan)`'s result when the runner stages ahead."""
        ...


@runtime_checkable
class StagingRunner(Runner, Protocol):
    """A runner that prepares a plan's host inputs ahead (ModelRunner, SimulatedRunner):
    the GPU stage calls `stage` as a plan arrives, while the step before still runs, and
    hands the result to `execute`. Plans are staged in order, one at a time."""

    def stage(self, plan: StepPlan) -> object:
        ...
