"""`EngineStats`: one snapshot of the engine's gauges and counters, read at each /metrics
scrape (web/metrics.py names them for Prometheus), as vLLM's SchedulerStats. It is always
`merge`d from its two halves' parts: the engine core's `CoreStats` and each request side's
`AccountStats` (one in one process, one per frontend process)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from stages.histogram import Histogram

if TYPE_CHECKING:
    from stages.account import Accountant
    from stages.schedule import Scheduler
    from stages.schedule.blocks import BlockManager


@attrs.frozen(kw_only=True)
class Latencies:
    """The accountant's latency histograms, in seconds (live objects, not copies)."""
    ttft: Histogram       # arrival to first token
    itl: Histogram        # between two tokens of one request
    e2e: Histogram        # arrival to last token, finished requests
    queue: Histogram      # arrival to first scheduled
    prefill: Histogram    # first scheduled to first token
    decode: Histogram     # first token to last token
    inference: Histogram  # first scheduled to last token (prefill + decode)


@attrs.frozen(kw_only=True)
class RequestShapes:
    """Histograms of counts per finished request (vLLM's request_* series) and per step
    (live objects, not copies)."""
    prompt_tokens: Histogram       # the request's prompt tokens (every prompt's)
    generation_tokens: Histogram   # its generated tokens (every choice's)
    params_n: Histogram            # its n
    params_max_tokens: Histogram   # its max_tokens, as resolved
    num_preemptions: Histogram     # how often its sequences were preempted (schedule's)
    iteration_tokens: Histogram    # tokens one engine step computed (schedule's)


@attrs.frozen(kw_only=True)
class SpecDecodeStats:
    """Speculative decoding's counters since start (--speculative-config), as vLLM's."""
    num_drafts: int = 0                # verify passes: sequences that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()   # [i]: drafts accepted at position i


@attrs.frozen(kw_only=True)
class EngineStats:
    """Gauges (the scheduler's queues, the KV blocks) and counters (`_total`, since start)."""
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0        # cached blocks count as free
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    requests_finished_total: Mapping[str, int] = attrs.field(factory=dict)  # by FinishReason
    steps_total: int = 0
    # vLLM's reasons a request waits: "capacity" (KV blocks, the batch) and "deferred"
    # (ready to run but for a transient: its grammar still compiling)
    num_waiting_by_reason: Mapping[str, int] = attrs.field(factory=dict)
    cache_config: Mapping[str, str] = attrs.field(factory=dict)   # vllm:cache_config_info's labels
    latency: Latencies | None = None
    shapes: RequestShapes | None = None
    spec_decode: SpecDecodeStats | None = None   # None: speculative decoding is off
    # data parallel (--data-parallel-size): each engine's stats, by rank (the gauges above
    # are their sums); /metrics labels their core series engine="K"
    engines: tuple[EngineStats, ...] = ()
    # vllm:lora_requests_info (issue 33): the adapters of the running and waiting requests;
    # max_loras 0: LoRA is off (no metric)
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0

    @classmethod
    def merge(cls, core: CoreStats, accounts: Sequence[AccountStats]) -> EngineStats:
        """The one EngineStats of an engine core and every request side it serves (one in one
        process, one per frontend with --api-server-count): counters summed, histograms added
        bucket by bucket. Without a request side there are no latencies or request shapes."""
        finished: dict[str, int] = {}
        for a in accounts:
            for k, v in a.requests_finished_total.items():
                finished[k] = finished.get(k, 0) + v
        latency = shapes = None
        if accounts:
            latency = Latencies(**{f.name: Histogram.summed(getattr(a.latency, f.name) for a in accounts)
                                   for f in attrs.fields(Latencies)})
            if core.request_preemptions is not None and core.iteration_tokens is not None:
                shapes = RequestShapes(
                    prompt_tokens=Histogram.summed(a.prompt_tokens for a in accounts),
                    generation_tokens=Histogram.summed(a.generation_tokens for a in accounts),
                    params_n=Histogram.summed(a.params_n for a in accounts),
                    params_max_tokens=Histogram.summed(a.params_max_tokens for a in accounts),
                    num_preemptions=core.request_preemptions, iteration_tokens=core.iteration_tokens)
        return cls(
            num_running=core.num_running, num_waiting=core.num_waiting,
            num_waiting_by_reason=core.num_waiting_by_reason, num_preemptions=core.num_preemptions,
            kv_blocks_total=core.kv_blocks_total, kv_blocks_free=core.kv_blocks_free,
            kv_blocks_used=core.kv_blocks_used, kv_blocks_cached=core.kv_blocks_cached,
            steps_total=core.steps_total, cache_config=core.cache_config,
            spec_decode=core.spec_decode, latency=latency, shapes=shapes,
            prompt_tokens_total=sum(a.prompt_tokens_total for a in accounts),
            generation_tokens_total=sum(a.generation_tokens_total for a in accounts),
            cached_tokens_total=sum(a.cached_tokens_total for a in accounts),
            prefix_cache_queries_total=sum(a.prefix_cache_queries_total for a in accounts),
            prefix_cache_hits_total=sum(a.prefix_cache_hits_total for a in accounts),
            requests_finished_total=finished, lora_running=core.lora_running,
            lora_waiting=core.lora_waiting, max_loras=core.max_loras)


# the request side's counters (each engine's own with data parallel)
_COUNTERS = ("num_running", "num_waiting", "num_preemptions", "kv_blocks_total", "kv_blocks_free",
             "kv_blocks_used", "kv_blocks_cached", "steps_total", "prompt_tokens_total",
             "generation_tokens_total", "cached_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total")


def _added(parts: Sequence, kind: type):
    """The attrs objects `parts` (None where absent) added field by field: histograms
    bucket by bucket, numbers summed, tuples position by position."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = {}
    for f in attrs.fields(kind):
        values = [getattr(p, f.name) for p in parts]
        if isinstance(values[0], Histogram):
            out[f.name] = Histogram.summed(values)
        elif isinstance(values[0], tuple):
            width = max(map(len, values))
            out[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            out[f.name] = sum(values)
    return kind(**out)


def sum_engines(stats: Sequence[EngineStats]) -> EngineStats:
    """Data parallel: the server's stats, every engine's added up (its gauges, counters,
    finished requests, histograms and speculative counters; each rank accounts for its own
    requests), with each engine's in `engines` for /metrics' `engine` label."""
    first = stats[0]
    finished: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for st in stats:
        for k, v in st.requests_finished_total.items():
            finished[k] = finished.get(k, 0) + v
        for k, v in st.num_waiting_by_reason.items():
            reasons[k] = reasons.get(k, 0) + v
    latency = _added([st.latency for st in stats], Latencies)
    shapes = _added([st.shapes for st in stats], RequestShapes)
    spec = _added([st.spec_decode for st in stats], SpecDecodeStats)
    return attrs.evolve(first, num_waiting_by_reason=reasons, requests_finished_total=finished,
                        latency=latency, shapes=shapes, spec_decode=spec, engines=tuple(stats),
                        **{f: sum(getattr(st, f) for st in stats) for f in _COUNTERS})


def cache_config_labels(cfg, num_blocks: int, max_model_len: int, prefix_caching: bool) -> dict[str, str]:
    """vllm:cache_config_info's labels (vLLM's CacheConfig field names) for an EngineConfig:
    with vLLM's kv_cache_size_tokens (the tokens the KV blocks hold) and
    kv_cache_max_concurrency (how many requests of max_model_len tokens fit at once:
    the blocks over one such request's blocks, as vLLM logs "Maximum concurrency").
    prefix_caching: as the engine runs it (--enable-prefix-caching resolved for the model)."""
    per_request = -(-max_model_len // cfg.block_size)
    return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(num_blocks),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "enable_prefix_caching": str(prefix_caching),
            "cache_dtype": cfg.kv_cache_dtype, "num_gpu_blocks_override": str(cfg.num_gpu_blocks_override),
            "kv_cache_size_tokens": str(num_blocks * cfg.block_size),
            "kv_cache_max_concurrency": str(round(num_blocks / per_request, 2)),
            "engine": "0"}


# -- the two halves' parts, and the one merge ------------------------------------------------
@attrs.frozen(kw_only=True)
class AccountStats:
    """One request side's accounting (stages/account.py's Accountant): its counters and
    histograms. Plain data: a frontend process sends it to the engine process."""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    requests_finished_total: Mapping[str, int] = attrs.field(factory=dict)
    latency: Latencies
    prompt_tokens: Histogram
    generation_tokens: Histogram
    params_n: Histogram
    params_max_tokens: Histogram

    @classmethod
    def of(cls, a: Accountant) -> AccountStats:
        """The accountant's numbers now (its histograms as they are, not copied)."""
        return cls(prompt_tokens_total=a.prompt_tokens_total,
                   generation_tokens_total=a.generation_tokens_total,
                   cached_tokens_total=a.cached_tokens_total,
                   prefix_cache_queries_total=a.prefix_cache_queries_total,
                   prefix_cache_hits_total=a.prefix_cache_hits_total,
                   requests_finished_total={str(k): v for k, v in a.finished_total.items()},
                   latency=Latencies(ttft=a.ttft, itl=a.itl, e2e=a.e2e, queue=a.queue,
                                     prefill=a.prefill, decode=a.decode,
                                     inference=a.inference),
                   prompt_tokens=a.request_prompt_tokens,
                   generation_tokens=a.request_generation_tokens,
                   params_n=a.request_params_n, params_max_tokens=a.request_params_max_tokens)


@attrs.frozen(kw_only=True)
class CoreStats:
    """The engine core's gauges and counters: the scheduler's queues, the KV blocks, the
    steps, speculative decoding (stages/schedule/, stages/schedule/blocks.py)."""
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_by_reason: Mapping[str, int] = attrs.field(factory=dict)
    num_preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    steps_total: int = 0
    cache_config: Mapping[str, str] = attrs.field(factory=dict)
    spec_decode: SpecDecodeStats | None = None
    request_preemptions: Histogram | None = None
    iteration_tokens: Histogram | None = None
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0

    @classmethod
    def of(cls, s: Scheduler, blocks: BlockManager, cache_config: Mapping[str, str],
           lora: bool = False) -> CoreStats:
        spec = None
        if s.drafter is not None:
            spec = SpecDecodeStats(num_drafts=s.spec.num_drafts,
                                   num_draft_tokens=s.spec.num_draft_tokens,
                                   num_accepted_tokens=s.spec.num_accepted_tokens,
                                   accepted_per_pos=tuple(s.spec.accepted_per_pos))
        # a remote prefill whose KV is being read waits, as vLLM's WAITING_FOR_REMOTE_KVS
        return cls(num_running=len(s.running),
                   num_waiting=len(s.waiting) + len(s.compiling) + len(s.kv.receiving),
                   num_waiting_by_reason={"capacity": len(s.waiting),
                                          "deferred": len(s.compiling)},
                   num_preemptions=s.num_preemptions, kv_blocks_total=blocks.num_blocks,
                   kv_blocks_free=blocks.num_free, kv_blocks_used=blocks.num_used,
                   kv_blocks_cached=len(blocks.cached), steps_total=s.step,
                   cache_config=cache_config, spec_decode=spec,
                   request_preemptions=s.request_preemptions,
                   iteration_tokens=s.iteration_tokens,
                   lora_running=_adapters(s.running) if lora else (),
                   lora_waiting=_adapters([*s.waiting, *s.compiling]) if lora else (),
                   max_loras=s.max_loras if lora else 0)


def _adapters(seqs) -> tuple[str, ...]:
    """The LoRA adapters' names among sequences, sorted, each once."""
    return tuple(sorted({q.req.lora.name for q in seqs if q.req.lora is not None}))
