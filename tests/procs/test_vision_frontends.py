"""Images behind `--api-server-count 2` (issue 34): each frontend fetches and preprocesses the
picture in render (numpy and Pillow, no torch), and the `ImageInput` (offset, length, hash,
pixels) crosses the frontend -> engine wire as plain data; the engine's tower encodes it.
On the tiny llava-hf LLaVA (tests/support/vision_models.py); the oracle is transformers' generate."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.serve_processes import json_on_new_connection, start
from tests.support.vision_chats import IMG_A, IMG_B, ask, data_url, hf_ask, hf_generate
from tests.support.vision_models import llava_dir


@pytest.fixture(scope="module")
def vision_frontends(tmp_path_factory):
    llava = llava_dir(tmp_path_factory)
    server = start(tmp_path_factory.mktemp("vision-frontends"), str(llava[0]),
                   "--api-server-count", "2", "--enable-prompt-tokens-details", "--served-model-name", "m",
                   "--max-num-batched-tokens", "16")     # chunks cut through the picture
    yield server, llava
    server.stop()


def _chat_on_new_connection(server, messages: list[dict]):
    """(pid of the frontend that accepted the connection, status, JSON body)."""
    return json_on_new_connection(server, "POST", "/v1/chat/completions",
                                  {"model": "m", "messages": messages, "max_tokens": 8,
                                   "temperature": 0, "return_token_ids": True})


def test_every_frontend_serves_pictures_as_transformers_answers(vision_frontends):
    server, llava = vision_frontends
    want = {name: hf_generate(llava, hf_ask("What is this?", 1), [img])
            for name, img in (("a", IMG_A), ("b", IMG_B))}
    assert want["a"][0] != want["b"][0]          # the picture decides the answer
    frontends = set(server.children()["frontend"])
    assert len(frontends) == 2
    seen: set[int] = set()
    tries = 0
    while seen != frontends:         # new connections until each frontend has answered
        tries += 1
        assert tries <= 40, f"one frontend answered every connection: {seen}"
        for name, img in (("a", IMG_A), ("b", IMG_B)):
            pid, status, body = _chat_on_new_connection(server, ask("What is this?", data_url(img)))
            assert status == 200, body
            tokens, n_prompt = want[name]
            assert body["choices"][0]["token_ids"] == tokens, (pid, name)
            assert body["usage"]["prompt_tokens"] == n_prompt
            assert body["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": 25}
            seen.add(pid)
    # the frontends fetched and preprocessed the pictures without torch
    for pid in frontends:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
