"""The checks render makes of a request's sampling fields, each a 400 in the API's shape:
beam search's combinations, logprobs against --max-logprobs, logprob_token_ids, the
thinking budget, and the logit controls (logit_bias, allowed_token_ids, bad_words)
checked against the vocabulary. Plain functions of the request, its plan and render's
context; torch-free."""
from __future__ import annotations

import math
from typing import Any

import attrs

from stages.api.common import PromptPlan, RequestError
from stages.api.request_types import ChoiceRequest

Context = Any   # stages.render.RenderContext (not imported: render imports this module)


def beam_width_of(req: ChoiceRequest, plan: PromptPlan, limits: list[int]) -> int:
    """use_beam_search: the width (n), or 0; a 400 for what beam search does not combine
    with (vLLM's beam search ignores these; here they are refused rather than dropped)."""
    if not req.use_beam_search:
        return 0
    if not math.isfinite(req.length_penalty):
        raise RequestError("'length_penalty' must be a finite number.", param="length_penalty")
    refused = (("stop", bool(req.stop)), ("response_format", plan.constraint is not None),
               ("prompt_logprobs", plan.prompt_logprobs is not None))
    for param, present in refused:
        if present:
            what = "a constrained output (structured outputs, or a named or required " \
                   "tool_choice)" if param == "response_format" else f"'{param}'"
            raise RequestError(f"'use_beam_search' does not combine with {what}.",
                               param="use_beam_search")
    if min(limits) < 1:
        raise RequestError("'use_beam_search' needs at least 1 token to generate "
                           "('max_tokens').", param="use_beam_search")
    return req.n


def held_logprobs(plan: PromptPlan, ctx: Context) -> PromptPlan:
    """The plan's logprobs and prompt_logprobs with -1 made the vocabulary size, each held
    to --max-logprobs (-1: the vocabulary), with vLLM's 400; logprob_token_ids' ids checked
    against the vocabulary."""
    vocab = vocab_size(ctx)
    cap = vocab if ctx.max_logprobs == -1 else ctx.max_logprobs

    def held(k: int | None, what: str, param: str) -> int | None:
        if k is None:
            return None
        if k == -1 and vocab is None:
            raise RequestError(f"'{param}' -1 (the whole vocabulary) needs the vocabulary "
                               f"size, which this server does not know.", param=param)
        n = vocab if k == -1 else k
        if cap is not None and n > cap:   # vLLM's words
            raise RequestError(f"Requested {what} logprobs of {n}, which is greater than max "
                               f"allowed: {cap}", param=param)
        return n

    if plan.logprob_token_ids:
        check_logprob_token_ids(plan.logprob_token_ids, vocab)
    return attrs.evolve(plan, logprobs=held(plan.logprobs, "sample", plan.logprobs_param),
                        prompt_logprobs=held(plan.prompt_logprobs, "prompt", "prompt_logprobs"))


MAX_LOGPROB_TOKEN_IDS = 128   # vLLM's bound on logprob_token_ids


def check_logprob_token_ids(ids: tuple[int, ...], vocab: int | None) -> None:
    """vLLM's rules and words for logprob_token_ids: at most 128 ids, each in the vocabulary."""
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise RequestError(f"Requested logprob_token_ids of length {len(ids)}, which is "
                           f"greater than max allowed: {MAX_LOGPROB_TOKEN_IDS}",
                           param="logprob_token_ids")
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise RequestError(f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab "
                           f"token ids. Vocabulary size: {vocab}", param="logprob_token_ids")


def thinking_budget(req, ctx: Context) -> int | None:
    budget = getattr(req, "thinking_token_budget", None)
    if budget is None or budget == -1:
        return None
    if not ctx.reasoning or ctx.harmony:
        raise RequestError("'thinking_token_budget' needs a <think> reasoning parser (start "
                           "the server with --reasoning-parser qwen3 or deepseek_r1).",
                           param="thinking_token_budget")
    if not ctx.think_tags:
        raise RequestError("'thinking_token_budget' needs <think> and </think> to be single "
                           "tokens of this model's tokenizer.", param="thinking_token_budget")
    return budget


def vocab_size(ctx: Context) -> int | None:
    """The model's embedding rows, else the tokenizer's vocabulary (None: neither known)."""
    return ctx.vocab_size or (None if ctx.tokenizer is None else ctx.tokenizer.vocab_size)


def check_vocab(ids, vocab: int | None, param: str, *, negative: bool = False) -> None:
    """Refuse the first id at or above `vocab` (no bound when None), or below 0 with
    `negative` (where the request's type does not already forbid it)."""
    bad = [t for t in ids if (negative and t < 0) or (vocab is not None and t >= vocab)]
    if bad:
        raise RequestError(f"Token id {bad[0]} is out of vocabulary: '{param}' has ids in "
                           f"[0, {vocab}).", param=param)


LOGIT_BIAS_LIMIT = 100.0   # OpenAI's range; vLLM clamps a bias into it


def logit_controls(req: ChoiceRequest, ctx: Context) -> dict[str, Any]:
    """logit_bias, allowed_token_ids and bad_words as the sampler takes them: ids checked
    against the vocabulary, biases clamped to [-100, 100], bad words tokenized."""
    out: dict[str, Any] = {}
    if not (req.logit_bias or req.allowed_token_ids or req.bad_words):
        return out
    vocab = vocab_size(ctx)
    if req.logit_bias:
        bias = {int(k): float(min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, v)))
                for k, v in req.logit_bias.items()}
        check_vocab(bias, vocab, "logit_bias")
        out["logit_bias"] = tuple(sorted(bias.items()))
    if req.allowed_token_ids:
        check_vocab(req.allowed_token_ids, vocab, "allowed_token_ids")
        out["allowed_token_ids"] = tuple(sorted(set(req.allowed_token_ids)))
    if req.bad_words:
        if ctx.tokenizer is None:
            raise RequestError("'bad_words' needs a tokenizer; this server was started "
                               "without one.", param="bad_words")
        words = bad_words_token_ids(req.bad_words, ctx.tokenizer)
        check_vocab([t for w in words for t in w], vocab, "bad_words")
        out["bad_words_token_ids"] = words
    return out


def bad_words_token_ids(words: list[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens as it starts the text, and, as vLLM does, also as it follows a
    space when that spelling is a different first token with as many tokens (so the
    word is banned both at the start and in the middle of the text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        word = word.lstrip()
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        variants = [plain]
        if plain and len(spaced) == len(plain) and spaced[0] != plain[0]:
            variants.append(spaced)
        out += [ids for ids in variants if ids and ids not in out]
    return tuple(out)
