"""Per-request stream accounting: a pure core fed with timestamped events.

Timestamps are integer nanoseconds from ``time.perf_counter_ns``, so the ITLs
are exact integer differences and ``latency - ttft == sum(itls)`` holds up
to the float conversion (well under a nanosecond).

Rules:
- TTFT starts at the first token-bearing event; metadata, role-only chunks
  and comments never start it.
- One ITL sample per token-bearing event after the first.
- E2EL ends at the last token-bearing event; usage chunks and terminal
  events do not extend it.
- output_tokens and prompt_len come from the final usage. Without usage,
  prompt_len keeps the locally computed length and output_tokens is the count
  of token-bearing events (no tokenizer on the hot path; servers that stream
  one token per event agree with it).
"""

from __future__ import annotations

import attrs

from web.bench.backends import Observation

_NS = 1e9


@attrs.frozen
class RequestResult:
    success: bool
    prompt_len: int
    output_tokens: int
    ttft: float  # seconds; 0.0 when no token arrived
    latency: float  # seconds from send to the last token-bearing event
    itls: tuple[float, ...]
    generated_text: str
    error: str = ""
    start_time: float = 0.0  # seconds, perf_counter clock

    @property
    def tpot(self) -> float | None:
        """(latency - ttft) / (output_tokens - 1), defined for more than one output token."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def failed_result(prompt_len: int, error: str, start_ns: int = 0) -> RequestResult:
    return RequestResult(success=False, prompt_len=prompt_len, output_tokens=0, ttft=0.0, latency=0.0,
                         itls=(), generated_text="", error=error, start_time=start_ns / _NS)


class StreamAccount:
    """Collects one request's observations; ``finish`` turns them into a result."""

    def __init__(self, *, prompt_len: int, start_ns: int) -> None:
        self.prompt_len = prompt_len
        self.start_ns = start_ns
        self.token_times: list[int] = []
        self.text_parts: list[str] = []
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.terminal = False
        self.error: str | None = None

    def observe(self, obs: Observation, now_ns: int) -> None:
        if obs.is_token:
            self.token_times.append(now_ns)
        if obs.text:
            self.text_parts.append(obs.text)
        if obs.usage is not None:
            if obs.usage.prompt_tokens is not None:
                self.prompt_tokens = obs.usage.prompt_tokens
            if obs.usage.output_tokens is not None:
                self.output_tokens = obs.usage.output_tokens
        if obs.terminal:
            self.terminal = True
        if obs.error is not None and self.error is None:
            self.error = obs.error

    def mark_terminal(self) -> None:
        self.terminal = True

    def finish(self, transport_error: str | None = None) -> RequestResult:
        """The result once the stream has ended (or broke with ``transport_error``)."""
        times = self.token_times
        problems = []
        if self.error is not None:
            problems.append(f"server error: {self.error}")
        else:
            if not times:
                problems.append("no token-bearing event received, so TTFT is undefined")
            if not self.terminal:
                detail = f" ({transport_error})" if transport_error else ""
                problems.append(f"stream ended before its terminal event{detail}")
        prompt_len = self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len
        output_tokens = self.output_tokens if self.output_tokens is not None else len(times)
        text = "".join(self.text_parts)
        ttft = (times[0] - self.start_ns) / _NS if times else 0.0
        latency = (times[-1] - self.start_ns) / _NS if times else 0.0
        itls = tuple((b - a) / _NS for a, b in zip(times, times[1:]))
        return RequestResult(
            success=not problems,
            prompt_len=prompt_len,
            output_tokens=output_tokens if not problems else 0,
            ttft=ttft,
            latency=latency,
            itls=itls,
            generated_text=text,
            error="; ".join(problems),
            start_time=self.start_ns / _NS,
        )
