"""account: usage (prompt, completion, reasoning, cached tokens) and timings.

Per request it keeps the token counts and four times (all time.monotonic()): queued (the
HTTP layer's arrival), first scheduled (schedule, on the delta), first token and last
token (the steps that brought them back). From those come vLLM's latency histograms for
/metrics and, with --enable-per-request-metrics, each request's own `metrics` object.
"""
from __future__ import annotations

import bisect

import attrs
import trio

from stages.delta import FinishReason, RequestMetrics, SpecRequestMetrics, Usage
from stages.histogram import (ITL_BUCKETS, N_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS, Histogram,
                              one_two_five)
from stages.messages import RenderedRequest, Step



class _RequestUsage:
    __slots__ = ("prompt", "completion", "reasoning", "arrival", "scheduled", "first_token",
                 "last_token", "wants_metrics", "open_choices", "cached", "n", "prompt_lens",
                 "prompt_cached", "continuous", "max_tokens", "spec", "per_choice", "cache_block")

    def __init__(self, req: RenderedRequest, cache_block: int = 0) -> None:
        self.cache_block = cache_block   # the prefix cache's block size (0: none)
        self.prompt = req.num_prompt_tokens      # every prompt's, once (not per choice)
        self.completion = 0
        self.reasoning = 0
        self.arrival = req.arrival
        self.scheduled = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.wants_metrics = req.per_request_metrics
        self.open_choices = req.num_choices   # usage sums every choice; it ends with the last
        self.cached = 0             # prompt tokens from the prefix cache (each prompt's first choice's)
        self.n = req.n
        self.prompt_lens = [len(p) for p in req.prompts] or [len(req.prompt_token_ids)]
        self.prompt_cached: list[int | None] = [None] * len(self.prompt_lens)
        self.continuous = req.continuous_usage   # every delta carries the usage so far
        self.max_tokens = req.sampling.max_tokens
        self.spec: list[int] | None = None   # [verify passes, draft tokens, accepted], once drafted
        # continuous usage of several choices: each choice's [completion, reasoning] tokens
        self.per_choice = ([[0, 0] for _ in range(req.num_choices)]
                           if self.continuous and req.num_choices > 1 else None)

    def created(self, p: int) -> int:
        """Prompt p's tokens written into the prefix cache, as vLLM counts them: every full
        block of the prompt is cached once computed, so its full blocks' tokens less those
        found there (0 until it was looked up, or without prefix caching)."""
        cached, bs = self.prompt_cached[p], self.cache_block
        if cached is None or not bs:
            return 0
        return max(0, self.prompt_lens[p] // bs * bs - cached)

    def usage(self, index: int) -> Usage:
        """The request's usage so far; with per-choice counts, choice `index`'s own too."""
        created = sum(map(self.created, range(len(self.prompt_lens)))) if self.cache_block else 0
        total = Usage(self.prompt, self.completion, self.cached, self.reasoning,
                      created_cache_tokens=created)
        if self.per_choice is None:
            return total
        p = index // self.n
        completion, reasoning = self.per_choice[index]
        own = Usage(self.prompt_lens[p], completion, self.prompt_cached[p] or 0, reasoning,
                    created_cache_tokens=self.created(p))
        return attrs.evolve(total, choice=own)

    def metrics(self) -> RequestMetrics:
        """The request's own timings (vLLM's per-request metrics), in milliseconds."""
        n = self.completion
        generation = (self.last_token - self.first_token) if n else 0.0
        since_scheduled = self.last_token - self.scheduled if n else 0.0
        timings = dict(
            queue_time_ms=_ms(self.scheduled - self.arrival) if self.scheduled else 0.0,
            time_to_first_token_ms=_ms(self.first_token - self.scheduled) if n else 0.0,
            generation_time_ms=_ms(generation),
            mean_itl_ms=_ms(generation / (n - 1)) if n > 1 else 0.0,
            tokens_per_second=round(n / since_scheduled, 3) if since_scheduled > 0 else 0.0)
        if self.spec is None:
            return RequestMetrics(**timings)
        drafts, draft_tokens, accepted = self.spec
        return SpecRequestMetrics(**timings, spec_num_drafts=drafts,
                                  spec_num_draft_tokens=draft_tokens,
                                  spec_num_accepted_tokens=accepted,
                                  spec_acceptance_length=round(1 + accepted / drafts, 3))


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class Accountant:
    """The pure core: per-request usage and timings, plus server-wide counters and
    latency histograms for /metrics."""

    def __init__(self, max_model_len: int = 1 << 20, cache_block: int = 0) -> None:
        """cache_block: the prefix cache's block size (0: no prefix caching), for usage's
        created_cache_tokens."""
        self.cache_block = cache_block
        """`max_model_len` bounds the token-count histograms' buckets (as vLLM's)."""
        self.requests: dict[str, _RequestUsage] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.prefix_cache_queries_total = 0   # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits_total = 0      # ... and found there
        self.finished_total: dict[FinishReason, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue = Histogram(REQUEST_BUCKETS)
        self.prefill = Histogram(REQUEST_BUCKETS)
        self.decode = Histogram(REQUEST_BUCKETS)
        self.inference = Histogram(REQUEST_BUCKETS)
        # per finished request, as vLLM's request_* histograms
        self.request_prompt_tokens = Histogram(one_two_five(max_model_len))
        self.request_generation_tokens = Histogram(one_two_five(max_model_len))
        self.request_params_n = Histogram(N_BUCKETS)
        self.request_params_max_tokens = Histogram(one_two_five(max_model_len))

    def process(self, msg: Step) -> tuple[Step, list[tuple[str, Usage, FinishReason]]]:
        """Returns the accounted step and the (request_id, usage, reason) of finished requests.

        A delta gets its `usage` where a reply reads it: each choice's last delta, and every
        delta of a stream with continuous usage stats. Any other delta passes on as it came
        (most deltas of most steps: a running sequence's one token)."""
        requests = self.requests
        for req in msg.new_requests:
            requests[req.request_id] = _RequestUsage(req, self.cache_block)
        now = msg.done_at
        deltas, finished = [], []
        # the ITL histogram inline (one observation per running sequence per step)
        itl = self.itl
        itl_bounds, itl_counts, itl_sum = itl.buckets, itl.counts, itl.sum
        generated = 0
        for d in msg.deltas:
            u = requests.get(d.request_id)
            if u is None:
                continue
            n = len(d.token_ids)
            index = d.index
            if index % u.n == 0:    # a prompt's first choice: its prompt's cache hits
                p = index // u.n
                cached = d.num_cached_tokens
                before = u.prompt_cached[p]
                if before is None and (n or d.scheduled_at):   # looked up
                    self.prefix_cache_queries_total += u.prompt_lens[p]
                    self.prefix_cache_hits_total += cached
                if before != cached:
                    u.prompt_cached[p] = cached
                    u.cached = sum(c or 0 for c in u.prompt_cached)
            if n:
                if not u.completion:
                    u.scheduled = d.scheduled_at
                    u.first_token = now
                    self.ttft.observe(now - u.arrival)
                elif index == 0:   # the gaps of one sequence (choices share steps)
                    gap = now - u.last_token
                    itl_counts[bisect.bisect_left(itl_bounds, gap)] += 1
                    itl_sum += gap
                u.last_token = now
                u.completion += n
                generated += n
            u.reasoning += d.reasoning_tokens   # this delta's (so a running usage grows)
            if u.per_choice is not None:
                own = u.per_choice[index]
                own[0] += n
                own[1] += d.reasoning_tokens
            if d.draft_tokens:
                if u.spec is None:
                    u.spec = [0, 0, 0]
                u.spec[0] += 1
                u.spec[1] += d.draft_tokens
                u.spec[2] += d.accepted_tokens
            reason = d.finish_reason
            if reason is None:
                deltas.append(d.accounted(u.usage(index)) if u.continuous else d)
                continue
            usage = u.usage(index)
            u.open_choices -= 1
            if u.open_choices > 0:
                deltas.append(d.accounted(usage))
                continue
            del requests[d.request_id]
            self.prompt_tokens_total += u.prompt
            self.cached_tokens_total += u.cached
            self.finished_total[reason] = self.finished_total.get(reason, 0) + 1
            if reason not in (FinishReason.ABORT, FinishReason.ERROR):
                self.request_prompt_tokens.observe(u.prompt)
                self.request_generation_tokens.observe(u.completion)
                self.request_params_n.observe(u.n)
                self.request_params_max_tokens.observe(u.max_tokens)
                if u.completion:
                    self.e2e.observe(u.last_token - u.arrival)
                    self.queue.observe(u.scheduled - u.arrival)
                    self.prefill.observe(u.first_token - u.scheduled)
                    self.decode.observe(u.last_token - u.first_token)
                    self.inference.observe(u.last_token - u.scheduled)
            finished.append((d.request_id, usage, reason))
            deltas.append(d.accounted(usage, u.metrics() if u.wants_metrics else None))
        itl.sum = itl_sum
        self.generation_tokens_total += generated
        return msg.with_deltas(tuple(deltas)), finished


class EngineAccounts:
    """Data parallel: one Accountant per engine rank, each fed its engine's steps (a request
    is served by one engine, so they partition the requests), so every metric can carry
    its `engine` label, as vLLM's."""

    def __init__(self, max_model_len: int, engines: int, cache_block: int = 0) -> None:
        self.parts = tuple(Accountant(max_model_len, cache_block) for _ in range(engines))

    def part(self, engine: int) -> Accountant:
        return self.parts[engine]

    def process(self, msg: Step) -> tuple[Step, list[tuple[str, Usage, FinishReason]]]:
        return self.parts[msg.engine].process(msg)


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              core: Accountant | EngineAccounts, log=None) -> None:
    async with receive, send:
        async for msg in receive:
            out, finished = core.process(msg)
            if log is not None:
                log("accounted", step=out.step, deltas=out.deltas)
                for rid, usage, reason in finished:
                    log("finished", request_id=rid, finish_reason=reason,
                        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                        cached_tokens=usage.cached_tokens, reasoning_tokens=usage.reasoning_tokens)
            await send.send(out)
