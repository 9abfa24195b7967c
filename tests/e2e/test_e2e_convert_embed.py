"""A decoder served as an embedding model (issue 32): `tailrace serve --convert embed` on the
bundled SmolLM2 GGUF: last-token pooling, normalized; vLLM's chat-style `messages` input;
the runner pooling, with no KV cache. The server declares Matryoshka sizes with
--hf-overrides (vLLM's flag), which `dimensions` then serves."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from gpu.interface import PoolingOptions, SamplingOptions, SeqChunk, SeqStart, StepPlan


@pytest.fixture(scope="module")
def http(serve_with_flags, tmp_path_factory):
    for server in serve_with_flags(tmp_path_factory.mktemp("e2e-convert"), "--convert", "embed",
                                   "--served-model-name", "smol-embed",
                                   "--hf-overrides", '{"matryoshka_dimensions": [64, 128]}'):
        with httpx.Client(base_url=server.url, timeout=300) as c:
            yield c


@pytest.fixture(scope="module")
def runner():
    from gpu.loader.pooling import load_pooling_model
    from gpu.worker.pooling_runner import PoolingRunner
    return PoolingRunner(load_pooling_model(None, convert="embed"))


def _pool(runner, ids: list[int]) -> np.ndarray:
    plan = StepPlan(1, (SeqChunk("a", tuple(ids), 0, (), True),),
                    (SeqStart("a", (), SamplingOptions(), pooling=PoolingOptions()),))
    return np.frombuffer(runner.execute(plan).pooled[0], dtype="<f4")


def test_embeddings_are_the_last_tokens_normalized(http, runner):
    r = http.post("/v1/embeddings", json={"input": ["The capital of France is", "Hello"],
                                          "encoding_format": "float"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "smol-embed" and len(body["data"][0]["embedding"]) == 576
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    np.testing.assert_allclose(body["data"][0]["embedding"], _pool(runner, ids), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(body["data"][1]["embedding"]), 1.0, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == len(ids) + len(
        http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"])


def test_chat_style_messages(http, runner):
    messages = [{"role": "user", "content": "What is an embedding?"}]
    r = http.post("/v1/embeddings", json={"messages": messages, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], _pool(runner, ids), atol=1e-5)


def test_generation_is_refused(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_hf_overrides_declare_matryoshka_sizes_that_dimensions_serves(http, runner):
    """The GGUF has no config.json: --hf-overrides' keys are laid over the config it makes.
    A declared size is the full vector's head, normalized again; any other is a 400 that
    names the declared ones."""
    ids = http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    full = _pool(runner, ids)
    for size in (64, 128):
        r = http.post("/v1/embeddings", json={"input": "Hello", "dimensions": size,
                                              "encoding_format": "float"})
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["data"][0]["embedding"])
        assert got.shape == (size,)
        np.testing.assert_allclose(got, full[:size] / np.linalg.norm(full[:size]), atol=1e-5)
    r = http.post("/v1/embeddings", json={"input": "Hello", "dimensions": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert "64" in r.json()["error"]["message"] and "128" in r.json()["error"]["message"]
