"""Constrained decoding with xgrammar: one grammar per constrained request, one matcher per
sequence, one token bitmask per engine step.

- `Constraint` (gpu/interface.py) is what a request asks for. `check()` converts it to a
  grammar without the tokenizer (fast), so render can refuse a bad schema or regex with a
  400 before anything starts.
- `GrammarCompiler` compiles constraints against the tokenizer's vocabulary in a worker
  thread (off the engine's step path), behind an LRU cache keyed by the constraint; the
  scheduler keeps a request waiting until its grammar is ready.
- The runner gives each constrained sequence a `Guide` (its `GrammarMatcher`, and whether
  reasoning still runs first); `mask_logits()` fills one bitmask for the batch and
  applies it to the logits before sampling (xgrammar's CPU kernel, or its Triton/torch
  one on CUDA); `accept()` advances the matchers. In a verify step (speculative decoding)
  a speculated sequence's rows get the masks of the grammar walked through its drafts
  (`Guide.draft_masks`, then rolled back), and the matcher advances through the tokens
  the step emits.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gpu.interface import Constraint, ConstraintCompiler, GrammarError

_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _message(exc: BaseException) -> str:
    return _XGR_PREFIX.sub("", str(exc)).strip()


def _choice_regex(spec: str) -> str:
    return "|".join(f"(?:{re.escape(c)})" for c in json.loads(spec))


def _grammar(c: Constraint):
    import xgrammar as xgr
    if c.kind == "json_schema":
        return xgr.Grammar.from_json_schema(c.spec, any_whitespace=not c.compact)
    if c.kind == "json_object":
        if c.compact:
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        return xgr.Grammar.builtin_json_grammar()
    if c.kind == "regex":
        return xgr.Grammar.from_regex(c.spec)
    if c.kind == "choice":
        return xgr.Grammar.from_regex(_choice_regex(c.spec))
    if c.kind == "grammar":
        return xgr.Grammar.from_ebnf(c.spec)
    return xgr.Grammar.from_structural_tag(c.spec)


def check(c: Constraint) -> None:
    """Raise GrammarError saying what is wrong with the constraint (no tokenizer needed)."""
    try:
        _grammar(c)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's words
        raise GrammarError(_message(exc)) from None


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
    """xgrammar's view of a gpu.tokenizers.tokenizer.Tokenizer (a `tokenizers.Tokenizer` inside):
    every token string by id, padded to the model's logits width."""
    import xgrammar as xgr
    hf = tokenizer.hf
    vocab = [""] * max(vocab_size, hf.get_vocab_size(with_added_tokens=True))
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        vocab[i] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
    return xgr.TokenizerInfo(vocab[:vocab_size], vocab_type=meta["vocab_type"],
                             vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCompiler(ConstraintCompiler):
    """Compiles constraints in one worker thread; the last `cache_size` stay cached."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._compiler = None     # built on first use, in the worker thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size

    def submit(self, c: Constraint) -> Future:
        """The compiled grammar's future (already done on a cache hit)."""
        with self._lock:
            fut = self._cache.get(c)
            if fut is not None:
                self._cache.move_to_end(c)
                return fut
            fut = self._pool.submit(self._compile, c)
            self._cache[c] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, c: Constraint):
        if self._compiler is None:
            import xgrammar as xgr
            info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(_grammar(c))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Guide:
    """One constrained sequence's matcher, and where it stands with reasoning.

    With a reasoning parser the constraint starts after the reasoning: `think` is the
    (open, close) token ids. A prompt that leaves <think> open starts in "thinking"
    (unconstrained until </think>); otherwise the model may still open one: "may_think"
    allows the grammar's tokens plus <think>. Without reasoning it is "active" at once.
    """

    def __init__(self, compiled, think: tuple[int, int] | None = None,
                 thinking: bool = False) -> None:
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.think = think
        self.phase = "active" if think is None else ("thinking" if thinking else "may_think")

    @property
    def masks(self) -> bool:
        return self.phase != "thinking" and not self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase == "may_think":
            word, bit = divmod(self.think[0], 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def accept(self, token: int) -> bool:
        """Advance past token; True when the matcher took a step (what rollback undoes)."""
        if self.phase == "may_think" and token == self.think[0]:
            self.phase = "thinking"
        elif self.phase == "thinking":
            if token == self.think[1]:
                self.phase = "active"
        elif not self.matcher.is_terminated():
            self.phase = "active"
            return bool(self.matcher.accept_token(token))
        return False

    def draft_masks(self, drafts: tuple[int, ...], bitmask: torch.Tensor, row0: int) -> list[int]:
        """A verify step's rows row0 .. row0 + len(drafts) of a speculated sequence: row j
        gets the mask of the grammar walked through drafts[:j], as the sequence will stand
        if those drafts hold; then the matcher is rolled back to where it was. A draft the
        grammar refuses ends the walk: the row before it samples a token the mask allows,
        so that draft is rejected there and what the rows after it sample is discarded
        (they stay unmasked). Returns the rows masked."""
        phase, steps, rows = self.phase, 0, []
        try:
            for j in range(len(drafts) + 1):
                masked = self.masks
                if masked:
                    self.fill(bitmask, row0 + j)
                    rows.append(row0 + j)
                if j == len(drafts):
                    break
                tok = drafts[j]
                if masked and not (int(bitmask[row0 + j, tok // 32]) >> (tok % 32)) & 1:
                    break
                steps += self.accept(tok)
        finally:
            if steps:
                self.matcher.rollback(steps)
            self.phase = phase
        return rows


def mask_logits(logits: torch.Tensor, guides: list, drafts: list | None = None) -> None:
    """Forbid, in place, every token the row's guide would reject (None: unconstrained).
    drafts (a verify step): per row, the drafts that follow it when it is a speculated
    sequence's first row (its guide then masks that row and the next len(drafts):
    `Guide.draft_masks`), else (). One bitmask for the batch; xgrammar applies it on the
    logits' device."""
    import xgrammar as xgr
    if not any(g is not None for g in guides):
        return
    bitmask = xgr.allocate_token_bitmask(len(guides), logits.shape[-1])
    rows: list[int] = []
    for i, g in enumerate(guides):
        if g is None:
            continue
        if drafts and drafts[i]:
            rows += g.draft_masks(drafts[i], bitmask, i)
        elif g.masks:
            g.fill(bitmask, i)
            rows.append(i)
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        indices=rows)


def accept(guides: list, tokens: list[int]) -> None:
    for g, tok in zip(guides, tokens):
        if g is not None:
            g.accept(tok)
