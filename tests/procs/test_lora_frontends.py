"""LoRA adapters behind `--api-server-count 2` (issue 33): each frontend renders with its own
snapshot of the start-up adapters (gpu/lora_spec.LoRARegistry pickles), so a request's
LoRARef crosses the frontend -> engine wire as plain data; runtime loading is refused with
a 400 on every frontend. On a tiny random Llama (tests/gpu) with a PEFT adapter made here;
the oracle is peft's merged model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.serve_processes import json_on_new_connection, start
from tests.support.hf_models import make_hf_model
from tests.support.lora_adapters import hf_greedy, make_adapter

PROMPT = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1]
N = 6


@pytest.fixture(scope="module")
def lora_frontends(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-frontends")
    hf = make_hf_model("llama", root / "base", tie_word_embeddings=False)
    merged = make_adapter(hf, root / "a", r=8, targets=["q_proj", "o_proj", "up_proj"], std=0.3)
    want = {"base": hf_greedy(hf, PROMPT, N)[0], "a": hf_greedy(merged, PROMPT, N)[0]}
    assert want["a"] != want["base"]
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        server = start(root, str(root / "base"), "--api-server-count", "2", "--enable-lora",
                       "--max-loras", "2", "--lora-modules", f"a={root / 'a'}",
                       "--served-model-name", "tiny")
    finally:
        if old is None:
            del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    yield server, root, want
    server.stop()


def test_every_frontend_serves_the_adapters_and_refuses_runtime_loading(lora_frontends):
    server, root, want = lora_frontends
    frontends = set(server.children()["frontend"])
    assert len(frontends) == 2
    seen: set[int] = set()
    tries = 0
    while seen != frontends:       # new connections until each frontend has answered
        tries += 1
        assert tries <= 40, f"one frontend answered every connection: {seen}"
        pid, status, models = json_on_new_connection(server, "GET", "/v1/models")
        assert status == 200
        cards = {m["id"]: m for m in models["data"]}
        assert set(cards) == {"tiny", "a"}
        assert cards["a"]["root"] == str(root / "a") and cards["a"]["parent"] == "tiny"
        for model in ("a", "tiny"):
            _, status, out = json_on_new_connection(server, "POST", "/v1/completions", {
                "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert status == 200, out
            assert out["model"] == model
            assert out["choices"][0]["token_ids"] == want["a" if model == "a" else "base"], model
        _, status, out = json_on_new_connection(server, "POST", "/v1/load_lora_adapter",
                                            {"lora_name": "b", "lora_path": str(root / "a")})
        assert status == 400 and "--api-server-count" in out["error"]["message"]
        _, status, out = json_on_new_connection(server, "POST", "/v1/unload_lora_adapter",
                                            {"lora_name": "a"})
        assert status == 400 and "--api-server-count" in out["error"]["message"]
        seen.add(pid)
    _, status, out = json_on_new_connection(server, "POST", "/v1/completions", {
        "model": "nope", "prompt": PROMPT, "max_tokens": 1})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    # the frontends render adapters without torch (gpu/lora/spec.py is torch-free)
    for pid in frontends:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
