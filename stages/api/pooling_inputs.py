"""render's half of a pooling request (issue 32): each input's token ids, truncated as
sentence-transformers truncates (special tokens kept, the text cut at its right end; a pair's
longer text first), and refused when too long without truncation.

Token-id inputs are taken as they are (no special tokens added); truncation keeps their
last tokens, as vLLM does.
A pair (a cross-encoder's query and document) is encoded as the tokenizer's post-processor
joins two texts, and its `segment` is where the second text's token type 1 starts (0 where
the model has a single token type, as RoBERTa).
"""
from __future__ import annotations

from typing import Any

from stages.api.common import RequestError
from stages.api.pooling import PoolingInput


def _limit(inp: PoolingInput, max_model_len: int) -> int | None:
    if inp.max_tokens is None:
        return None
    check_truncation(inp.max_tokens, max_model_len)
    return max_model_len if inp.max_tokens == -1 else inp.max_tokens


def check_truncation(keep: int, max_model_len: int) -> None:
    """As vLLM: truncate_prompt_tokens above the model's length is a 400, not clamped."""
    if keep > max_model_len:
        raise RequestError(f"'truncate_prompt_tokens' value ({keep}) is greater than "
                           f"max_model_len ({max_model_len}). Please request a smaller "
                           "truncation size.", param="truncate_prompt_tokens")


def input_ids(inp: PoolingInput, tokenizer: Any, max_model_len: int, vocab_size: int | None,
              text: str | None = None) -> tuple[list[int], int]:
    """(token ids, segment) of one input; `text` replaces inp.text (a rendered chat)."""
    keep = _limit(inp, max_model_len)
    segment = 0
    if keep == 0:
        raise RequestError("'truncate_prompt_tokens' 0 leaves no input.", param="truncate_prompt_tokens")
    if inp.token_ids is not None:
        bad = [t for t in inp.token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise RequestError(f"'{inp.param}' has token id {bad[0]}, which is out of vocabulary "
                               f"(ids are in [0, {vocab_size})).", param=inp.param)
        ids = list(inp.token_ids[-keep:] if keep is not None else inp.token_ids)
    elif tokenizer is None:
        raise RequestError("This server has no tokenizer: inputs must be token ids.", param=inp.param)
    elif inp.pair is not None:
        hf = tokenizer.hf
        a = hf.encode(inp.pair[0], add_special_tokens=False)
        b = hf.encode(inp.pair[1], add_special_tokens=False)
        if keep is not None:
            room = max(0, keep - hf.num_special_tokens_to_add(True))
            la, lb = len(a.ids), len(b.ids)
            while la + lb > room:          # longest first, as transformers' tokenizers
                if la > lb:
                    la -= 1
                else:
                    lb -= 1
            a.truncate(la)
            b.truncate(lb)
        enc = hf.post_process(a, b, add_special_tokens=True)
        ids = enc.ids
        segment = next((i for i, t in enumerate(enc.type_ids) if t == 1), 0)
    else:
        source = inp.text if text is None else text
        hf = tokenizer.hf
        enc = hf.encode(source, add_special_tokens=False)
        if keep is not None:
            enc.truncate(max(0, keep - (hf.num_special_tokens_to_add(False) if inp.add_special_tokens else 0)))
        ids = hf.post_process(enc, add_special_tokens=inp.add_special_tokens).ids
    if not ids:
        raise RequestError(f"'{inp.param}' must not be empty.", param=inp.param)
    if len(ids) > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, '{inp.param}' "
            f"has {len(ids)} tokens. Please reduce the length of the input, or set "
            f"'truncate_prompt_tokens'.", param=inp.param, code="context_length_exceeded")
    return ids, segment
