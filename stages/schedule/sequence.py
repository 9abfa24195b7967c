"""The scheduler's own state for one choice of a request: mutable, owned by the schedule
stage alone (the messages it sends stay frozen)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import attrs

from gpu.interface import SamplingOptions, TokenLogprobs
from stages.messages import RenderedRequest
from stages.schedule import stop

if TYPE_CHECKING:
    from stages.schedule.beam import BeamGroup


class Sequence:
    """One choice of a request (one sequence of tokens)."""

    def __init__(self, req: RenderedRequest, eos_token_ids: tuple[int, ...], max_model_len: int,
                 index: int = 0, leader: Sequence | None = None) -> None:
        self.req = req
        self.index = index
        # The GPU side knows sequences by id: a request's own id, or id#index for several.
        self.id = req.request_id if req.num_choices == 1 else f"{req.request_id}#{index}"
        # Choices after the first of a prompt wait for the first one's prompt to be in the
        # cache, so they take its blocks through the prefix cache instead of prefilling again.
        self.leader = leader
        prompt = req.prompt_of(index)
        self.prompt_len = len(prompt)
        self.token_ids: list[int] = list(prompt)
        # prompt_logprobs: the first choice of each prompt computes them (not from the cache)
        self.prompt_logprobs = (req.sampling.prompt_logprobs if leader is None else None)
        self.prompt_logprobs_so_far: list[TokenLogprobs] = []   # gathered until the first delta
        # Tokens in the KV cache once the steps planned so far have run (a planned chunk
        # counts at once, so that with async scheduling the next plan continues after it).
        self.num_computed = 0
        # Tokens sampled by planned steps whose results have not come back, which the next
        # chunk feeds as PLACEHOLDERs: only AsyncScheduler plans ahead (stages/schedule/
        # async_.py), so for the plain Scheduler it is 0 whenever it plans.
        self.num_pending = 0
        self.num_done = 0       # tokens in the KV cache by the steps that have come back
        # chunks planned whose results have not come back: their tokens, and their drafts
        # (async scheduling with n-gram drafts plans a floating chunk behind a verify pass:
        # async_.py; update rolls back to the verified tokens plus these)
        self.in_flight_tokens = 0
        self.in_flight_drafts = 0
        self.epoch = 0          # bumped by preemption: an older step's chunk is stale
        self.retired = False
        # its place in priority order (priority.py): (priority, arrival, index), and a
        # forked beam's serial after them (beam.py)
        self.order: tuple[int, ...] = (0, 0, index)
        self.table: list[int] = []
        self.table_t: tuple[int, ...] = ()   # tuple(table), for the chunks: kept with table
        self.passed = 0     # hybrid KV: leading blocks whose sliding halves it let go (blocks.py)
        self.slot = -1      # a hybrid model's state slot while it runs (state_slots.py)
        self.num_cached_tokens = 0
        self.first_scheduled = False
        self.scheduled_at = 0.0   # time.monotonic() when first scheduled
        # The prefix-hash chain starts from the request's cache_salt, when it has one, and
        # its LoRA adapter's id, when it runs with one: two adapters never share KV blocks.
        self.hash_root = None if req.cache_salt is None else hash(("cache_salt", req.cache_salt))
        if req.lora is not None:
            self.hash_root = hash(("lora", req.lora.id, self.hash_root))
        self.hash_cursor: tuple[int, int | None] = (0, self.hash_root)
        self.block_keys: dict[int, tuple] | None = None   # pictures' hashes by block (blocks.py)
        # what the stop rule reads (stages/schedule/stop.py)
        sp = req.sampling
        self.max_tokens = req.max_tokens_of(index)
        self.stop_ids = stop.stop_ids(sp, eos_token_ids)
        self.stop_token_ids = frozenset(sp.options.stop_token_ids)   # their id is the stop_reason
        self.end_len = stop.end_len(self.prompt_len, self.max_tokens, max_model_len)
        self.grammar: Future | None = None     # the compiled grammar, while it compiles
        # the KV connector (issue 36): a remote prefill's blocks still to read (until they land)
        kv = req.kv_transfer
        self.remote_prefill = kv.remote_prefill if kv is not None else None
        # speculative decoding: verify steps, drafts proposed, drafts accepted
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0
        # beam search (beam.py): the group it is a live beam of, its score's cumulative
        # logprob, the shown logprobs of its output tokens, what the runner samples it with
        self.beam: BeamGroup | None = None
        self.cum_logprob = 0.0
        self.beam_logprobs: tuple[TokenLogprobs, ...] = ()
        self.beam_options: SamplingOptions | None = None

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed


def sampling_options(seq: Sequence) -> SamplingOptions:
    """The request's options, with EOS among the stop ids unless ignore_eos (min_tokens
    masks them all); choice i of a seeded request draws from seed + i. A beam: what
    beam.py asks (greedy, the top 2 x width logprobs)."""
    if seq.beam_options is not None:
        return seq.beam_options
    opts = seq.req.sampling.options
    choice = seq.index % seq.req.n     # within its prompt
    seed = opts.seed if opts.seed is None or not choice else opts.seed + choice
    return attrs.evolve(opts, stop_token_ids=tuple(sorted(seq.stop_ids)), seed=seed)
