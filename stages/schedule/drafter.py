"""Speculative decoding's drafting step: `--speculative-config` and the n-gram drafter.

The scheduler asks a `Drafter` for up to K tokens to follow a sequence's tokens; the
runner scores the sequence's last token and the drafts in one forward pass and keeps the
drafts while each equals the token it samples at that position (gpu/worker/sampler.py,
`verify`). A draft only saves time; it never changes what is sampled.

`NgramDrafter` is prompt lookup (vLLM's "ngram" method): the longest suffix of the tokens
so far, between prompt_lookup_min and prompt_lookup_max tokens long, that occurred
earlier in the prompt or the output, proposes the K tokens that followed its first
occurrence. Each sequence keeps an index (n-gram -> where it first ended), grown by the
tokens added since its last lookup, so a lookup costs O(new tokens), not O(context).

`"method": "draft_model"` drafts with a smaller model of the same vocabulary, which runs
in the GPU stage beside the target (gpu/worker/spec_decode/draft.py): its `ModelDrafter` here only says how
many drafts a decode carries, as DRAFT placeholders the runner fills in before it verifies.
`"method": "eagle"` and `"eagle3"` draft the same way, with an EAGLE head that reads the
target's hidden states (gpu/worker/spec_decode/eagle.py) in place of a draft model.
"""
from __future__ import annotations

import json
from typing import Protocol

import attrs

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# the methods whose drafts the runner makes (a model or a head beside the target)
MODEL_METHODS = ("draft_model", "eagle", "eagle3")

# A draft token the scheduler leaves to the runner (method draft_model): the draft model,
# run in the GPU step before the verify forward, writes the real one.
DRAFT = -2


@attrs.frozen
class SpeculativeConfig:
    """vLLM's --speculative-config (methods ngram and draft_model), checked at construction."""
    method: str = "ngram"
    # draft_model: the draft's path (a .gguf, a HF folder); eagle/eagle3: the head's folder
    model: str | None = None
    # draft_model/eagle/eagle3: the draft's dtype (tailrace's own key; default: the target's)
    dtype: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 5     # vLLM's defaults; one bound given alone sets the other
    prompt_lookup_max: int = 5
    # no drafts while this many sequences or more run (vLLM's disable_by_batch_size):
    # a large batch is compute-bound and verifying drafts that fail costs real work
    disable_by_batch_size: int | None = None
    # tailrace's own key: decide each step from the measured cost of verifying against the
    # measured gain (spec.py CostGate), so that speculation is never slower than off
    adaptive: bool = True

    def __attrs_post_init__(self) -> None:
        def whole(name: str, v: object, lo: int) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"--speculative-config: {name} must be an integer >= {lo}, "
                                 f"got {v!r}")
            return v
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method {self.method!r} is not supported "
                             f"(supported: {', '.join(SPECULATIVE_METHODS)})")
        k = whole("num_speculative_tokens", self.num_speculative_tokens, 1)
        if k > 32:
            raise ValueError(f"--speculative-config: num_speculative_tokens {k} is more than 32")
        lo = whole("prompt_lookup_min", self.prompt_lookup_min, 1)
        hi = whole("prompt_lookup_max", self.prompt_lookup_max, 1)
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lo}) is larger than "
                             f"prompt_lookup_max ({hi})")
        if self.disable_by_batch_size is not None:
            whole("disable_by_batch_size", self.disable_by_batch_size, 1)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"--speculative-config: adaptive must be true or false, "
                             f"got {self.adaptive!r}")
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            what = "the draft model's path" if self.method == "draft_model" else "the head's folder"
            raise ValueError(f'--speculative-config: method "{self.method}" needs "model" ({what})')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('--speculative-config: "model" is for methods draft_model, eagle '
                             'and eagle3, not "ngram"')
        if self.dtype is not None and self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--speculative-config: dtype {self.dtype!r} is not one of auto, "
                             "float32, bfloat16, float16")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From the flag's JSON text or a dict (None stays None); unknown keys are errors.
        As in vLLM, a lookup bound given alone sets the other, and none gives 5 and 5."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r} "
                             f"(known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError('--speculative-config needs "method" (supported: '
                             + ", ".join(SPECULATIVE_METHODS) + ")")
        if "num_speculative_tokens" not in value:
            raise ValueError('--speculative-config needs "num_speculative_tokens"')
        value = dict(value)
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            value["prompt_lookup_max"] = value["prompt_lookup_min"]
        elif "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = value["prompt_lookup_max"]
        return cls(**value)


class Drafter(Protocol):
    """Proposes draft tokens for a sequence; `forget` drops what it kept for one."""

    def propose(self, seq_id: str, token_ids: list[int], k: int) -> tuple[int, ...]:
        ...

    def forget(self, seq_id: str) -> None:
        ...


class NgramIndex:
    """One sequence's n-grams (n in [lo, hi]), each mapped to the position where its first
    occurrence ends; grown as tokens are added."""

    __slots__ = ("lo", "hi", "first_end", "indexed")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.first_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0          # n-grams ending before this position are in first_end

    def extend(self, tokens: list[int]) -> None:
        first_end, lo, hi = self.first_end, self.lo, self.hi
        for end in range(self.indexed, len(tokens)):
            for n in range(lo, min(hi, end + 1) + 1):
                first_end.setdefault(tuple(tokens[end - n + 1:end + 1]), end)
        self.indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        self.extend(tokens)
        last = len(tokens) - 1
        for n in range(min(self.hi, len(tokens) - 1), self.lo - 1, -1):
            end = self.first_end.get(tuple(tokens[last - n + 1:]))
            if end is not None and end < last:      # an earlier occurrence than the suffix
                return tuple(tokens[end + 1:min(end + 1 + k, len(tokens))])
        return ()


class NgramDrafter:
    """Prompt lookup over each sequence's prompt and output (module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, seq_id: str, token_ids: list[int], k: int) -> tuple[int, ...]:
        if k <= 0:
            return ()
        index = self.indexes.get(seq_id)
        if index is None:
            index = self.indexes[seq_id] = NgramIndex(self.lo, self.hi)
        return index.propose(token_ids, k)

    def forget(self, seq_id: str) -> None:
        self.indexes.pop(seq_id, None)


class StandInDrafter(NgramDrafter):
    """For the GPU stand-in (--simulate-gpu with --simulate-draft-acceptance), whose random
    tokens leave prompt lookup little to find: the lookup runs (its host cost is real) and
    its proposal is padded to k with the last token, so that every decode verifies k
    drafts and the stand-in's acceptance probability decides how many hold."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        # method draft_model: the stand-in prices the draft's forwards and catch-ups
        # (gpu/worker/simulate.py StandInDraft), which the gate's probes take into account
        self.catches_up = config.method == "draft_model"

    def propose(self, seq_id: str, token_ids: list[int], k: int) -> tuple[int, ...]:
        found = super().propose(seq_id, token_ids, k)
        return found + (token_ids[-1],) * (k - len(found)) if k > 0 else ()


class ModelDrafter:
    """methods draft_model, eagle and eagle3, the scheduler's half: every decode offered
    drafts carries k DRAFT placeholders, which the draft model (gpu/worker/spec_decode/draft.py) or the EAGLE
    head (gpu/worker/spec_decode/eagle.py) fills in the GPU step. A draft model catches its KV up to a
    sequence's tokens when the sequence drafts (its whole prompt the first time), which
    the cost gate's probes take into account (spec.py Speculation `LAG`); an EAGLE head
    reads the target's states as they come (gpu/worker/spec_decode/eagle.py), with little to catch up."""

    def __init__(self, catches_up: bool = False) -> None:
        self.catches_up = catches_up

    def propose(self, seq_id: str, token_ids: list[int], k: int) -> tuple[int, ...]:
        return (DRAFT,) * k if k > 0 else ()

    def forget(self, seq_id: str) -> None:
        pass


def make_drafter(config: SpeculativeConfig | None, stand_in: bool = False) -> Drafter | None:
    if config is None:
        return None
    if stand_in:     # the stand-in has no draft model: it draws the acceptance instead
        return StandInDrafter(config)
    if config.method in MODEL_METHODS:
        return ModelDrafter(catches_up=config.method == "draft_model")
    return NgramDrafter(config)
