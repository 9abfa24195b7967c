"""`Engine.stats()`: one snapshot of the engine's gauges and counters, read at each
/metrics scrape (web/metrics.py names them for Prometheus), as vLLM's SchedulerStats."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from stages.lib.histogram import Histogram


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


def cache_config_labels(cfg, num_blocks: int) -> dict[str, str]:
    """vllm:cache_config_info's labels (vLLM's CacheConfig field names) for an EngineConfig."""
    return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(num_blocks),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "cache_dtype": "auto", "num_gpu_blocks_override": str(cfg.num_gpu_blocks_override),
            "engine": "0"}
