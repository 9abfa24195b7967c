"""`Engine.stats()`: one snapshot of the engine's gauges and counters, read at each
/metrics scrape (web/metrics.py names them for Prometheus), as vLLM's SchedulerStats."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from stages.account import Histogram


@attrs.frozen(kw_only=True)
class Latencies:
    """The accountant's latency histograms, in seconds (live objects, not copies)."""
    ttft: Histogram       # arrival to first token
    itl: Histogram        # between two tokens of one request
    e2e: Histogram        # arrival to last token, finished requests
    queue: Histogram      # arrival to first scheduled
    prefill: Histogram    # first scheduled to first token
    decode: Histogram     # first token to last token


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
    latency: Latencies | None = None
    spec_decode: SpecDecodeStats | None = None   # None: speculative decoding is off
