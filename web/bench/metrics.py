"""Summary statistics, goodput, the printed table and the saved JSON fields."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs
import numpy as np

from web.bench.account import RequestResult
from web.bench.backends import BenchConfigError

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "e2el:5000"]`` -> ``{"ttft": 200.0, "e2el": 5000.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, colon, value = item.partition(":")
        if not colon or name not in GOODPUT_METRICS:
            raise BenchConfigError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchConfigError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise BenchConfigError(f"--goodput {item!r}: the SLO must not be negative")
    return slos


def parse_metric_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        raise BenchConfigError(f"--percentile-metrics: unknown {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise BenchConfigError(f"--metric-percentiles {text!r}: expected comma-separated numbers") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise BenchConfigError("--metric-percentiles: each percentile must be in (0, 100]")
    return values


def percentile_key(p: float) -> str:
    return "p" + (str(int(p)) if p == int(p) else str(p))


def is_good(result: RequestResult, slos: dict[str, float]) -> bool:
    """A successful request meeting every given SLO; TPOT is vacuously met for one output token."""
    if not result.success:
        return False
    if "ttft" in slos and result.ttft * 1000 > slos["ttft"]:
        return False
    if "e2el" in slos and result.latency * 1000 > slos["e2el"]:
        return False
    tpot = result.tpot
    if "tpot" in slos and tpot is not None and tpot * 1000 > slos["tpot"]:
        return False
    return True


def _stats(name: str, values_s: Iterable[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = np.asarray(list(values_s), dtype=np.float64) * 1000
    empty = values.size == 0
    stats = {
        f"mean_{name}_ms": 0.0 if empty else float(values.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(values)),
        f"std_{name}_ms": 0.0 if empty else float(values.std()),
    }
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(values, p))
    return stats


def summarize(results: Sequence[RequestResult], duration: float, *, percentiles: Sequence[float] = (99.0,),
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The vLLM-named summary fields; all four latency metrics are always present."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
    }
    if goodput:
        good = sum(1 for r in results if is_good(r, goodput))
        summary["request_goodput"] = good / duration if duration > 0 else 0.0
    series = {
        "ttft": (r.ttft for r in ok),
        "tpot": (r.tpot for r in ok if r.tpot is not None),
        "itl": (itl for r in ok for itl in r.itls),
        "e2el": (r.latency for r in ok),
    }
    for name in METRICS:
        summary.update(_stats(name, series[name], percentiles))
    return summary


def detailed_fields(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """Per-request arrays, in request order; times in seconds."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [list(r.itls) for r in results],
        "e2els": [r.latency for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


@attrs.frozen
class TableOptions:
    metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    percentiles: tuple[float, ...] = (99.0,)


def format_table(summary: dict[str, Any], options: TableOptions = TableOptions()) -> str:
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for name in options.metrics:
        short, title = METRIC_TITLES[name]
        lines.append(title.center(width, "-"))
        row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{name}_ms"])
        for p in options.percentiles:
            row(f"P{percentile_key(p)[1:]} {short} (ms):", summary[f"{percentile_key(p)}_{name}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)
