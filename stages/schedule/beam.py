"""Beam search inside the engine (`use_beam_search`, vLLM's BeamSearchParams semantics).

A beam request's prompt (each prompt of a completions batch) is one `BeamGroup`. Its live
beams are `Sequence`s the scheduler plans like any other, one decode token each; the
runner samples them greedily and returns each row's top 2 x width logprobs
(`beam_options`). Once every live beam of a group has its row for the round, `rank` keeps
the `width` best of the candidates (a beam extended by one of its top tokens, scored by
vLLM's `score`: cumulative logprob / length ** length_penalty, the length counting the
prompt and not a final EOS); a candidate ending in EOS (unless ignore_eos) is a finished
hypothesis instead. The scheduler then forks: the first child of a beam continues its
sequence, each further child is a new sequence that holds the parent's full KV blocks
by reference count (blocks.py) and gets a fresh block for the partly filled last one,
the first block the beams would write differently, whose few tokens it computes again
in its next chunk (copy-on-write, the copy done by recomputing); a beam with no child is
dropped. After max_tokens rounds the live beams join the finished hypotheses and the
`width` best, by score, are the request's choices 0..width-1, each sent downstream once,
whole, in one Delta (so a stream gets them at the end).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from gpu.interface import SamplingOptions, TokenLogprobs
from stages.delta import FinishReason

if TYPE_CHECKING:
    from stages.schedule.sequence import Sequence


def score(num_tokens: int, last: int | None, cum_logprob: float, eos: frozenset[int],
          length_penalty: float) -> float:
    """vLLM's get_beam_search_score: num_tokens counts the prompt too, less a final EOS."""
    if last is not None and last in eos:
        num_tokens -= 1
    return cum_logprob / (num_tokens ** length_penalty)


def beam_options(width: int, logprobs: int | None) -> SamplingOptions:
    """What the runner is asked for a beam row: greedy (the token it samples is not used),
    the top 2 x width logprobs (raw, as vLLM's), and the request's own top_logprobs."""
    return SamplingOptions(temperature=0.0, logprobs=max(2 * width, logprobs or 0))


@attrs.define
class Hypothesis:
    """A finished beam: its output tokens, cumulative logprob, why it ended."""
    tokens: tuple[int, ...]
    cum_logprob: float
    finish: FinishReason
    stop_reason: int | None
    logprobs: tuple[TokenLogprobs, ...]
    score: float


@attrs.define(eq=False)
class Candidate:
    parent: Sequence
    row: TokenLogprobs
    token: int
    logprob: float
    cum_logprob: float
    score: float


class BeamGroup:
    """The beams of one prompt of a beam-search request."""

    def __init__(self, first: Sequence, width: int, length_penalty: float,
                 eos: frozenset[int], ignore_eos: bool, include_eos: bool,
                 logprobs: int | None) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.eos = eos                      # the model's EOS ids (for the score, and the finish)
        self.ignore_eos = ignore_eos
        self.include_eos = include_eos      # include_stop_str_in_output: EOS in the tokens
        self.logprobs = logprobs            # the request's top_logprobs; None: none shown
        self.choice0 = first.index          # its prompt's first choice
        self.prompt_len = first.prompt_len
        self.rounds = first.end_len - first.prompt_len    # max_tokens (or max_model_len)
        self.first = first                  # its first beam (the cached-token count, times)
        self.emitted = False                # its choices have gone downstream
        self.live: list[Sequence] = [first]
        self.rows: dict[str, TokenLogprobs] = {}        # this round's row per live beam id
        self.finished: list[Hypothesis] = []
        self.round = 0
        self.serial = 0                     # for the ids of forked beams

    def next_id(self, request_id: str) -> str:
        self.serial += 1
        return f"{request_id}#beam{self.choice0}.{self.serial}"

    def ready(self) -> bool:
        return all(s.id in self.rows for s in self.live)

    def rank(self) -> list[Candidate]:
        """The round's `width` best continuing candidates, best first; the candidates
        ending in EOS (unless ignore_eos) become finished hypotheses."""
        cands: list[Candidate] = []
        k = 2 * self.width
        for beam in self.live:
            row = self.rows[beam.id]
            n = beam.num_output + 1 + self.prompt_len
            for tok, lp in zip(row.top_ids[:k], row.top_logprobs[:k]):
                cum = beam.cum_logprob + lp
                if tok in self.eos and not self.ignore_eos:
                    toks = tuple(beam.token_ids[self.prompt_len:])
                    lps = beam.beam_logprobs
                    if self.include_eos:
                        toks, lps = toks + (tok,), self.extend(lps, row, lp)
                    last = toks[-1] if toks else None
                    self.finished.append(Hypothesis(
                        toks, cum, FinishReason.STOP, tok, lps,
                        score(self.prompt_len + len(toks), last, cum, self.eos,
                              self.length_penalty)))
                else:
                    cands.append(Candidate(beam, row, tok, lp, cum,
                                           score(n, tok, cum, self.eos, self.length_penalty)))
        cands.sort(key=lambda c: c.score, reverse=True)     # stable: ties keep beam order
        self.rows = {}
        self.round += 1
        return cands[:self.width]

    def extend(self, lps: tuple[TokenLogprobs, ...], row: TokenLogprobs,
               lp: float) -> tuple[TokenLogprobs, ...]:
        """A beam's shown logprobs and its chosen token's (its logprob, the row's top
        `top_logprobs` alternatives); none when the request asked for none."""
        if self.logprobs is None:
            return ()
        k = self.logprobs
        return lps + (TokenLogprobs(lp, row.top_ids[:k], row.top_logprobs[:k]),)

    def done(self) -> bool:
        return self.round >= self.rounds

    def best(self, kept: list[Candidate]) -> list[Hypothesis]:
        """The last round's kept candidates join the finished hypotheses (as vLLM's live
        beams do after max_tokens rounds): the `width` best by score."""
        for c in kept:
            beam = c.parent
            toks = tuple(beam.token_ids[self.prompt_len:]) + (c.token,)
            self.finished.append(Hypothesis(
                toks, c.cum_logprob, FinishReason.LENGTH, None,
                self.extend(beam.beam_logprobs, c.row, c.logprob), c.score))
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:self.width]
