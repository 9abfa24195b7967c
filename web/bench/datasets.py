"""Benchmark prompts: random token prompts, ShareGPT conversations, custom JSONL.

Only ``encode(text, add_special_tokens=False)``, ``decode(ids)`` and
``vocab_size`` are used from the tokenizer.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import attrs
import numpy as np
import orjson

from web.bench.backends import BenchConfigError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@attrs.frozen
class SampleRequest:
    prompt: str
    prompt_len: int  # local token count; the server's usage replaces it when reported
    expected_output_len: int


def _length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return low, high


def random_requests(tokenizer: Tokenizer, *, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """Prompts of random token ids, lengths uniform in [len*(1-r), len*(1+r)].

    Every prompt starts with the same ``prefix_len`` random tokens. The decoded
    text may re-tokenize differently, so prompt_len is measured on the text sent.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise BenchConfigError("--random-range-ratio must be in [0, 1)")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise BenchConfigError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
    rng = np.random.default_rng(seed)
    vocab = int(tokenizer.vocab_size)
    in_low, in_high = _length_bounds(input_len, range_ratio)
    out_low, out_high = _length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    prefix = rng.integers(0, vocab, size=prefix_len).tolist()
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        ids = prefix + rng.integers(0, vocab, size=n_in).tolist()
        prompt = tokenizer.decode(ids)
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, expected_output_len=n_out))
    return requests


def _fill(requests: list[SampleRequest], num_prompts: int, rng: np.random.Generator, source: str) -> list[SampleRequest]:
    if not requests:
        raise BenchConfigError(f"{source} holds no usable prompts")
    if len(requests) >= num_prompts:
        return requests[:num_prompts]
    # Too few prompts: reuse randomly chosen ones so the load shape is what was asked.
    extra = rng.choice(len(requests), size=num_prompts - len(requests))
    return requests + [requests[i] for i in extra.tolist()]


# The ShareGPT pruning bounds the vLLM benchmark uses, so results are comparable.
_MIN_LEN = 4
_MAX_PROMPT_LEN = 1024
_MAX_TOTAL_LEN = 2048


def sharegpt_requests(tokenizer: Tokenizer, path: str | Path, *, num_prompts: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """The first human turn as prompt; the first gpt answer's token count as output length.

    Conversations with fewer than two turns, very short prompts or answers, a
    prompt over 1024 tokens or a total over 2048 are skipped (the output-length
    checks are skipped when ``output_len`` is fixed).
    """
    entries = orjson.loads(Path(path).read_bytes())
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(entries)).tolist()
    requests: list[SampleRequest] = []
    for index in order:
        if len(requests) >= num_prompts:
            break
        turns = entries[index].get("conversations") or entries[index].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        answer_len = len(tokenizer.encode(answer, add_special_tokens=False)) if output_len is None else output_len
        if prompt_len < _MIN_LEN or prompt_len > _MAX_PROMPT_LEN:
            continue
        if output_len is None and (answer_len < _MIN_LEN or prompt_len + answer_len > _MAX_TOTAL_LEN):
            continue
        requests.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, expected_output_len=answer_len))
    return _fill(requests, num_prompts, rng, f"ShareGPT file {path}")


def custom_requests(tokenizer: Tokenizer, path: str | Path, *, num_prompts: int, output_len: int,
                    seed: int = 0, shuffle: bool = True) -> list[SampleRequest]:
    """JSONL lines with "prompt" and an optional "output_tokens" (else ``output_len``)."""
    requests: list[SampleRequest] = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row = orjson.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise BenchConfigError(f"{path}:{number}: each line needs a string \"prompt\"")
            n_out = int(row.get("output_tokens") or output_len)
            prompt_len = len(tokenizer.encode(row["prompt"], add_special_tokens=False))
            requests.append(SampleRequest(prompt=row["prompt"], prompt_len=prompt_len, expected_output_len=n_out))
    rng = np.random.default_rng(seed)
    if shuffle:
        requests = [requests[i] for i in rng.permutation(len(requests)).tolist()]
    return _fill(requests, num_prompts, rng, f"custom file {path}")
