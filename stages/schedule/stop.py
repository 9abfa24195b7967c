"""The stop rule (vLLM's check_stop): whether a sequence stops after the tokens a step gave
it, and why. The one place that decides EOS, a stop token id, max_tokens, max_model_len and
echo alone; the scheduler's update applies it, and planning asks it how much room is left.

The sampler masks every stop id until min_tokens outputs, so a stop id that comes back is
always a stop. A stop id is checked before the length: the last token a sequence may have
that is also EOS ends it with STOP.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from stages.delta import FinishReason
from stages.messages import SamplingParams

if TYPE_CHECKING:
    from stages.schedule.sequence import Sequence


@attrs.frozen
class Stop:
    """Why a sequence stopped: the finish reason, and the request's stop token id that ended
    it (the API's stop_reason; None for EOS and the length limits)."""
    reason: FinishReason
    stop_token: int | None = None


LENGTH = Stop(FinishReason.LENGTH)    # max_tokens or max_model_len (or echo alone)
EOS = Stop(FinishReason.STOP)


def stop_ids(sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids that end a sequence: the request's stop_token_ids, and EOS unless ignore_eos.
    A grammar ends on EOS (its matcher allows nothing else once complete), so a constrained
    sequence stops on EOS even with ignore_eos."""
    ids = frozenset(sampling.options.stop_token_ids)
    if sampling.ignore_eos and sampling.constraint is None:
        return ids
    return ids | frozenset(eos_token_ids)


def end_len(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """len(token_ids) at which a sequence ends by length: max_tokens or max_model_len."""
    return min(prompt_len + max_tokens, max_model_len)


def check_stop(seq: Sequence, tokens: tuple[int, ...]) -> tuple[int, Stop | None]:
    """(how many of `tokens`, the step's new tokens in order, the sequence keeps; why it
    stops, or None if it goes on). A verified run of drafts is cut after the token that
    stops it. Echo alone (max_tokens 0) keeps none: the prompt was computed for its
    logprobs, and the token sampled after it is not part of the reply."""
    if seq.max_tokens == 0:
        return 0, LENGTH
    room = seq.end_len - len(seq.token_ids)
    ids = seq.stop_ids
    kept = 0
    for tok in tokens:
        kept += 1
        if tok in ids:
            return kept, (Stop(FinishReason.STOP, tok) if tok in seq.stop_token_ids else EOS)
        if kept >= room:
            return kept, LENGTH
    return kept, None


def tokens_left(seq: Sequence, num_tokens: int) -> int:
    """Tokens the sequence may still sample once it holds `num_tokens` (its known tokens and
    those on their way) before the length limit ends it: 0 means the last is on its way."""
    return seq.end_len - num_tokens
