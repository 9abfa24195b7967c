"""Prometheus metrics read from `engine.stats()` at scrape time.

Names follow vLLM's (`vllm:num_requests_running` -> `tailrace:num_requests_running`).
Known stats get their own name and help text; any other numeric stat is exported
as `tailrace:<key>` (a counter when the key ends in `_total`), and a stat that is
a dict of numbers becomes one labelled metric, so new engine stats show up
without touching this file.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stages.delta import FinishReason

PREFIX = "tailrace:"

# stats key -> (metric name without prefix, help, label name for dict-valued stats)
_KNOWN: dict[str, tuple[str, str, str | None]] = {
    "num_running": ("num_requests_running", "Requests in the running batch.", None),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled.", None),
    "num_preemptions": ("num_preemptions_total", "Sequences preempted for KV space.", None),
    "kv_blocks_total": ("kv_blocks_capacity", "KV cache blocks in all.", None),
    "kv_blocks_free": ("kv_blocks_free", "KV cache blocks free (cached blocks count as free).",
                       None),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests.", None),
    "kv_blocks_cached": ("kv_blocks_cached", "KV cache blocks holding reusable prefixes.", None),
    "prompt_tokens_total": ("prompt_tokens_total", "Prompt tokens processed.", None),
    "generation_tokens_total": ("generation_tokens_total", "Tokens generated.", None),
    "cached_tokens_total": ("cached_tokens_total", "Prompt tokens served from the prefix cache.",
                            None),
    "requests_finished_total": ("request_success_total", "Requests finished, by reason.",
                                "finished_reason"),
    "steps_total": ("engine_steps_total", "Engine steps run.", None),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _family(name: str, doc: str, labels: list[str] | None = None) -> Metric:
    if name.endswith("_total"):
        return CounterMetricFamily(PREFIX + name[: -len("_total")], doc, labels=labels)
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


class EngineCollector(Collector):
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for key, value in stats.items():
            name, doc, label = _KNOWN.get(key, (key, f"Engine stat {key}.", "key"))
            if key == "requests_finished_total" and isinstance(value, dict):
                # every reason from the start (0 until one happens), as vLLM exports them
                value = {**dict.fromkeys(FinishReason, 0), **value}
            if _is_number(value):
                family = _family(name, doc)
                family.add_metric([], value)
            elif isinstance(value, dict) and all(_is_number(v) for v in value.values()):
                family = _family(name, doc, [label or "key"])
                for k, v in value.items():
                    family.add_metric([str(k)], v)
            else:
                continue
            yield family
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        if _is_number(used) and _is_number(total) and total:
            family = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                       "KV cache usage: 1 means every block is held.")
            family.add_metric([], used / total)
            yield family
