"""bench serve's openai-embeddings backend (issue 32): payloads, the one-body reply, flags."""
from __future__ import annotations

import argparse

import orjson
import pytest

from web.bench.backends import BACKENDS, BenchConfigError, SamplingParams
from web.bench.serve import add_arguments, build_config
from web.bench.sse import SSEEvent


def test_payload_and_interpretation():
    b = BACKENDS["openai-embeddings"]
    assert (b.default_endpoint, b.stream) == ("/v1/embeddings", False)
    assert b.build_payload(model="m", prompt=["a", "b"], max_tokens=5, sampling=SamplingParams(),
                           extra_body={"truncate_prompt_tokens": -1}) == {
        "model": "m", "input": ["a", "b"], "truncate_prompt_tokens": -1}
    body = {"data": [{"index": 0, "embedding": [0.1]}], "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    obs = b.interpret(SSEEvent(orjson.dumps(body).decode()))
    assert obs.is_token and obs.terminal and obs.usage.prompt_tokens == 7 and obs.usage.output_tokens == 0
    err = b.interpret(SSEEvent('{"error": {"message": "too long"}}'))
    assert err.error == "too long"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_flags():
    cfg = build_config(_args("--backend", "openai-embeddings", "--inputs-per-request", "16"))
    assert cfg.inputs_per_request == 16 and cfg.url.endswith("/v1/embeddings")
    with pytest.raises(BenchConfigError, match="inputs-per-request"):
        build_config(_args("--backend", "openai-chat", "--inputs-per-request", "4"))
    with pytest.raises(BenchConfigError, match="temperature"):
        build_config(_args("--backend", "openai-embeddings", "--temperature", "0.5"))
