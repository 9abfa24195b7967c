"""Prometheus metrics read from `engine.stats()` (pipeline.core.stats.EngineStats) at scrape time.

The series vLLM exports carry vLLM's names (`vllm:num_requests_running`, ...) and a
`model_name` label, so dashboards and autoscalers built for vLLM work unchanged.
tailrace's own series keep a `tailrace:` prefix; a field of EngineStats without a name
here is exported as `tailrace:<field>` (a counter when it ends in `_total`), and one that
maps names to numbers becomes one labelled metric, so new engine stats show up without
touching this file.

With data parallel (--data-parallel-size, `EngineStats.engines`), every series of one
engine's figures carries an `engine` label, one row per engine, as vLLM's: the cores'
(queues, KV cache, preemptions, steps, cache_config_info, speculative counters) and the
request side's (tokens, finished requests, latency and request histograms; each engine
accounts for the requests it served). The waiting-by-reason and LoRA series are the
server's.
"""
from __future__ import annotations

import time

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import attrs
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pipeline.core.stats import EngineStats
from stages.delta import FinishReason

if TYPE_CHECKING:
    from pipeline.core.engine import Engine

PREFIX = "tailrace:"
VLLM = "vllm:"

# EngineStats field -> (vLLM's metric name, help)
_VLLM: dict[str, tuple[str, str]] = {
    "num_running": ("num_requests_running", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "num_preemptions": ("num_preemptions_total", "Sequences preempted for KV space."),
    "prompt_tokens_total": ("prompt_tokens_total", "Prompt tokens processed."),
    "generation_tokens_total": ("generation_tokens_total", "Tokens generated."),
    "prefix_cache_queries_total": ("prefix_cache_queries_total",
                                   "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": ("prefix_cache_hits_total",
                                "Prompt tokens found in the prefix cache."),
}
# Latencies field -> (vLLM's histogram name, help)
_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "ttft": ("time_to_first_token_seconds", "Time to first token: arrival to first token."),
    "itl": ("inter_token_latency_seconds", "Time between two tokens of one request."),
    "e2e": ("e2e_request_latency_seconds", "Arrival to last token, finished requests."),
    "queue": ("request_queue_time_seconds", "Arrival to first scheduled."),
    "prefill": ("request_prefill_time_seconds", "First scheduled to first token."),
    "decode": ("request_decode_time_seconds", "First token to last token."),
    "inference": ("request_inference_time_seconds", "First scheduled to last token."),
}
# RequestShapes field -> (vLLM's histogram name, help)
_SHAPES: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("request_prompt_tokens", "Prompt tokens per finished request."),
    "generation_tokens": ("request_generation_tokens", "Generated tokens per finished request."),
    "params_n": ("request_params_n", "The n request parameter, per finished request."),
    "params_max_tokens": ("request_params_max_tokens",
                          "The max_tokens request parameter (resolved), per finished request."),
    "num_preemptions": ("request_num_preemptions", "Preemptions per request."),
    "iteration_tokens": ("iteration_tokens_total",
                         "Tokens per engine step: the prompts of sequences that got their "
                         "first token, plus the tokens generated (vLLM's definition)."),
}
# fields exported under vLLM's names by _vllm (not again as tailrace:<field>)
_AS_VLLM = ("latency", "shapes", "num_waiting_by_reason", "cache_config", "spec_decode")
# vLLM's request_success_total counts finished requests only, not aborts or errors.
_SUCCESS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)
# EngineStats field -> (tailrace metric name, help, label name for a mapping)
_OWN: dict[str, tuple[str, str, str | None]] = {
    "kv_blocks_total": ("kv_blocks_capacity", "KV cache blocks in all.", None),
    "kv_blocks_free": ("kv_blocks_free", "KV cache blocks free (cached blocks count as free).",
                       None),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests.", None),
    "kv_blocks_cached": ("kv_blocks_cached", "KV cache blocks holding reusable prefixes.", None),
    "cached_tokens_total": ("cached_tokens_total", "Prompt tokens served from the prefix cache.",
                            None),
    "requests_finished_total": ("requests_finished_total",
                                "Requests ended, by reason (aborts and errors included).",
                                "finished_reason"),
    "steps_total": ("engine_steps_total", "Engine steps run.", None),
}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _family(name: str, doc: str, labels: list[str] | None = None) -> Metric:
    if name.endswith("_total"):
        return CounterMetricFamily(name[: -len("_total")], doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


class EngineCollector(Collector):
    """`snapshot`, when set, is what the next collection exports (a frontend process
    fetches it from the engine process before a scrape); else `engine.stats()`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot if self.snapshot is not None else self.engine.stats()
        model = self.engine.model_names[0]
        yield from _vllm(stats, model)
        yield from _own(stats)


# EngineStats fields that are one engine's (labelled engine="K" with data parallel)
_PER_ENGINE = ("num_running", "num_waiting", "num_preemptions", "kv_blocks_total",
               "kv_blocks_free", "kv_blocks_used", "kv_blocks_cached", "steps_total",
               *_VLLM, "cached_tokens_total", "requests_finished_total")


def _engines(stats: EngineStats, labels: list[str]) -> tuple[list[str], list]:
    """Label names and rows ([engine label value, or none], one engine's EngineStats): one
    per engine with data parallel, else the server's one."""
    if stats.engines:
        return [*labels, "engine"], [([str(k)], e) for k, e in enumerate(stats.engines)]
    return labels, [([], stats)]


def _rows(stats: EngineStats, field: str, labels: list[str]) -> tuple[list[str], list]:
    """A field's label names and rows ([label values], value): one per engine with data
    parallel (an `engine` label) for a field of one engine's, else the one."""
    if stats.engines and field in _PER_ENGINE:
        return ([*labels, "engine"],
                [(str(k), getattr(e, field)) for k, e in enumerate(stats.engines)])
    return labels, [(None, getattr(stats, field))]


def _vllm(stats: EngineStats, model: str) -> Iterator[Metric]:
    for field, (name, doc) in _VLLM.items():
        names, rows = _rows(stats, field, ["model_name"])
        family = _family(VLLM + name, doc, names)
        for engine, value in rows:
            family.add_metric([model] if engine is None else [model, engine], value)
        yield family
    if stats.kv_blocks_total:
        names, per = _engines(stats, ["model_name"])
        family = GaugeMetricFamily(VLLM + "kv_cache_usage_perc",
                                   "KV cache usage: 1 means every block is held.", labels=names)
        for k, e in per:
            family.add_metric([model, *k],
                              e.kv_blocks_used / e.kv_blocks_total if e.kv_blocks_total else 0.0)
        yield family
    names, per = _engines(stats, ["model_name", "finished_reason"])
    family = CounterMetricFamily(VLLM + "request_success",
                                 "Requests finished (not aborted, not failed), by reason.",
                                 labels=names)
    for k, e in per:
        for reason in _SUCCESS:   # every reason from the start, 0 until one happens
            family.add_metric([model, str(reason), *k], e.requests_finished_total.get(reason, 0))
    yield family
    family = GaugeMetricFamily(VLLM + "num_requests_waiting_by_reason",
                               "Requests waiting, by why: capacity (KV blocks, the batch) or "
                               "deferred (their grammar still compiling).",
                               labels=["model_name", "reason"])
    for reason in ("capacity", "deferred"):
        family.add_metric([model, reason], stats.num_waiting_by_reason.get(reason, 0))
    yield family
    if stats.max_loras:      # vLLM's: the value is the scrape's time, the adapters in labels
        family = GaugeMetricFamily(VLLM + "lora_requests_info", "Running stats on LoRA requests.",
                                   labels=["running_lora_adapters", "max_lora",
                                           "waiting_lora_adapters"])
        family.add_metric([",".join(stats.lora_running), str(stats.max_loras),
                           ",".join(stats.lora_waiting)], time.time())
        yield family
    if stats.cache_config:   # an info metric: always 1, the configuration in its labels
        family = GaugeMetricFamily(VLLM + "cache_config_info",
                                   "Information of the engine's cache configuration.",
                                   labels=list(stats.cache_config))
        for e in stats.engines or (stats,):
            family.add_metric([e.cache_config.get(k, "") for k in stats.cache_config], 1)
        yield family
    labels, per = _engines(stats, ["model_name"])
    for group, names, unit in (("latency", _HISTOGRAMS, "_seconds"), ("shapes", _SHAPES, "")):
        kind = getattr(stats, group)
        if kind is None:
            continue
        for field in attrs.fields(type(kind)):
            name, doc = names.get(field.name, (field.name + unit, f"Histogram {field.name}."))
            family = HistogramMetricFamily(VLLM + name, doc, labels=labels)
            for k, e in per:
                if getattr(e, group) is not None:
                    hist = getattr(getattr(e, group), field.name)
                    family.add_metric([model, *k], _go_bounds(hist.cumulative()), hist.sum)
            yield family
    if stats.spec_decode is not None:
        yield from _spec_decode(stats, model)


# -- speculative decoding (vLLM's spec_decode counters) ---------------------------------------
_SPEC: dict[str, tuple[str, str]] = {
    "num_drafts": ("spec_decode_num_drafts", "Verify passes: sequences that carried drafts."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


def _spec_decode(stats: EngineStats, model: str) -> Iterator[Metric]:
    labels, per = _engines(stats, ["model_name"])
    per = [(k, e.spec_decode) for k, e in per if e.spec_decode is not None]
    for field, (name, doc) in _SPEC.items():
        family = CounterMetricFamily(VLLM + name, doc, labels=labels)
        for k, spec in per:
            family.add_metric([model, *k], getattr(spec, field))
        yield family
    family = CounterMetricFamily(VLLM + "spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by their position among the drafts.",
                                 labels=["model_name", "position", *labels[1:]])
    for k, spec in per:
        for pos, n in enumerate(spec.accepted_per_pos):
            family.add_metric([model, str(pos), *k], n)
    yield family


def _go_bounds(cumulative: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Bucket bounds as prometheus_client (and so vLLM) writes them: le="1.0", not "1"."""
    return [(b if b == "+Inf" else floatToGoString(b), n) for b, n in cumulative]


def _own(stats: EngineStats) -> Iterator[Metric]:
    for field in attrs.fields(type(stats)):    # a field added to EngineStats needs no name here
        key = field.name
        if key in _VLLM or key in _AS_VLLM:
            continue
        name, doc, label = _OWN.get(key, (key, f"Engine stat {key}.", "key"))
        value = getattr(stats, key)
        if key == "requests_finished_total":
            names, per = _engines(stats, [label])
            family = _family(PREFIX + name, doc, names)
            for k, e in per:
                for reason, v in {**dict.fromkeys(FinishReason, 0),
                                  **e.requests_finished_total}.items():
                    family.add_metric([str(reason), *k], v)
        elif _is_number(value):
            names, rows = _rows(stats, key, [])
            family = _family(PREFIX + name, doc, names)
            for engine, v in rows:
                family.add_metric([] if engine is None else [engine], v)
        elif isinstance(value, Mapping) and all(_is_number(v) for v in value.values()):
            family = _family(PREFIX + name, doc, [label or "key"])
            for k, v in value.items():
                family.add_metric([str(k)], v)
        else:
            continue
        yield family
