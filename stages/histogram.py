"""Prometheus-style histograms and vLLM's bucket bounds: what account and schedule
observe for /metrics (pipeline/core/stats.py carries them, web/metrics.py exports them)."""
from __future__ import annotations

import bisect

# vLLM's buckets, so dashboards built for it read the same ranges.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)


def one_two_five(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value (max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Observations in fixed buckets (upper bounds), with their sum, as Prometheus
    histograms count them; the web layer exports them."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @classmethod
    def summed(cls, hists) -> Histogram:
        """A new histogram holding every observation of `hists` (the same buckets)."""
        hists = list(hists)
        out = cls(hists[0].buckets)
        for h in hists:
            if h.buckets != out.buckets:
                raise ValueError("histograms with different buckets do not add up")
            out.counts = [x + y for x, y in zip(out.counts, h.counts)]
            out.sum += h.sum
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out
