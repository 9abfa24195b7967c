"""Images in chat and Responses over HTTP (issue 34): the tiny llava-hf LLaVA
(tests/support/vision_models.py) served by one `tailrace serve`, driven by the openai client,
against transformers' generate and processor on the same weights and pictures; the media
fetch's refusals against a local HTTP server (a hanging one included)."""
from __future__ import annotations

import base64
import http.server
import json
import socketserver
import threading
import time

import httpx
import pytest

from tests.support.vision_chats import (IMG_A, IMG_B, ask, data_url, hf_ask, hf_generate, image_part,
                                        picture, png)
from tests.support.vision_models import llava_dir

FETCH_TIMEOUT_S = 2.0
MAX_BYTES = 64 * 1024


class _Media(http.server.BaseHTTPRequestHandler):
    """/a.png, /b.png, /text, /big, /hang (never answers), /drip (a byte a second),
    /loop (redirects to itself), /away (redirects to another host name)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path in ("/a.png", "/b.png"):
            return self._send(png(IMG_A if self.path == "/a.png" else IMG_B), "image/png")
        if self.path == "/text":
            return self._send(b"hello, not a picture", "text/plain")
        if self.path == "/big":
            return self._send(b"\0" * (MAX_BYTES + 1), "image/png")
        if self.path == "/hang":
            time.sleep(FETCH_TIMEOUT_S * 3)
            return None
        if self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(int(FETCH_TIMEOUT_S * 4)):
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
            return None
        if self.path == "/loop":
            return self._redirect(f"http://127.0.0.1:{self.server.server_port}/loop")
        if self.path == "/away":
            return self._redirect(f"http://localhost:{self.server.server_port}/a.png")
        self.send_error(404)

    def _send(self, body: bytes, kind: str):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str):
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


@pytest.fixture(scope="module")
def media():
    srv = _Server(("127.0.0.1", 0), _Media)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return llava_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("local-media")
    (d / "a.png").write_bytes(png(IMG_A))
    return d


@pytest.fixture(scope="module")
def vl(llava, local_dir, tmp_path_factory, serve_with_flags):
    import openai

    folder = llava[0]
    for server in serve_with_flags(
            tmp_path_factory.mktemp("e2e-vision-server"), str(folder),
            # steps of 16 tokens: every prefill is chunked, cutting through a picture's 25
            "--max-num-batched-tokens", "16",
            "--enable-prompt-tokens-details", "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(local_dir),
            "--media-fetch-timeout", str(FETCH_TIMEOUT_S), "--max-media-bytes", str(MAX_BYTES)):
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        yield server, client, client.models.list().data[0].id


def chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 8),
                                          extra_body={"return_token_ids": True}, **kw)


def test_greedy_tokens_and_usage_equal_transformers(vl, llava):
    _, client, model = vl
    want, n_prompt = hf_generate(llava, hf_ask("What is this?", 1), [IMG_A])
    r = chat(client, model, ask("What is this?", data_url(IMG_A)))
    assert r.choices[0].token_ids == want
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.prompt_tokens_details.multimodal_tokens == {"image": 25}
    # two pictures: 50 image tokens, the processor's count, transformers' tokens
    want2, n2 = hf_generate(llava, hf_ask("Compare them.", 2), [IMG_A, IMG_B])
    r2 = chat(client, model, ask("Compare them.", data_url(IMG_A), data_url(IMG_B)))
    assert r2.choices[0].token_ids == want2
    assert r2.usage.prompt_tokens == n2
    assert r2.usage.prompt_tokens_details.multimodal_tokens == {"image": 50}
    # the picture changes the answer: another picture, other tokens
    other, _ = hf_generate(llava, hf_ask("What is this?", 1), [IMG_B])
    assert other != want


def test_stream_n2_and_an_earlier_turn(vl, llava):
    _, client, model = vl
    want, _ = hf_generate(llava, hf_ask("Describe it.", 1), [IMG_B])
    stream = client.chat.completions.create(
        model=model, messages=ask("Describe it.", data_url(IMG_B)), temperature=0, max_tokens=8,
        stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    ids, usage = [], None
    for chunk in stream:
        for c in chunk.choices:
            ids += getattr(c, "token_ids", None) or []
        usage = chunk.usage or usage
    assert ids == want
    assert usage.prompt_tokens_details.multimodal_tokens == {"image": 25}
    r = chat(client, model, ask("Describe it.", data_url(IMG_B)), n=2)
    assert [c.token_ids for c in r.choices] == [want, want]
    # a picture in an earlier turn of the chat
    history = [*ask("What is this?", data_url(IMG_A)),
               {"role": "assistant", "content": "A picture."},
               {"role": "user", "content": "And its colour?"}]
    hf_history = [*hf_ask("What is this?", 1), {"role": "assistant", "content": "A picture."},
                  {"role": "user", "content": "And its colour?"}]
    want_h, n_h = hf_generate(llava, hf_history, [IMG_A])
    r = chat(client, model, history)
    assert r.choices[0].token_ids == want_h and r.usage.prompt_tokens == n_h


def test_prefix_cache_keys_on_the_picture(vl, media):
    _, client, model = vl
    first = chat(client, model, ask("Which colour?", data_url(IMG_B)), max_tokens=1)
    again = chat(client, model, ask("Which colour?", f"{media}/b.png"), max_tokens=1)  # same pixels
    other = chat(client, model, ask("Which colour?", data_url(picture(50, 31, 3))), max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].token_ids == first.choices[0].token_ids


def test_responses_input_image_shorthand_and_file_urls(vl, llava, local_dir):
    server, client, model = vl
    want, _ = hf_generate(llava, hf_ask("What is this?", 1), [IMG_A])
    text = client.chat.completions.create(
        model=model, messages=ask("What is this?", data_url(IMG_A)), temperature=0,
        max_tokens=8).choices[0].message.content
    resp = client.responses.create(model=model, temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMG_A)},
                                     {"type": "input_text", "text": "What is this?"}]}])
    assert resp.output_text == text
    # vLLM's shorthand {"image_url": "..."}, and a file:// URL under --allowed-local-media-path
    for part in ({"image_url": data_url(IMG_A)},
                 {"type": "image_url", "image_url": {"url": (local_dir / "a.png").as_uri()}}):
        body = {"model": model, "temperature": 0, "max_tokens": 8, "return_token_ids": True,
                "messages": [{"role": "user", "content": [part, {"type": "text",
                                                                 "text": "What is this?"}]}]}
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want


def test_chat_kv_transfer_prompt_token_ids_ignored_with_non_text_content(vl, llava):
    _, client, model = vl
    want, n_prompt = hf_generate(llava, hf_ask("What is this?", 1), [IMG_A])
    r = client.chat.completions.create(
        model=model, messages=ask("What is this?", data_url(IMG_A)), temperature=0, max_tokens=8,
        extra_body={"return_token_ids": True, "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}})
    assert r.usage.prompt_tokens == n_prompt and r.choices[0].token_ids == want


def test_every_refusal_is_a_400_naming_the_part(vl, media, tmp_path):
    server, _, model = vl
    outside = tmp_path / "x.png"
    outside.write_bytes(png(IMG_A))
    cases = {
        "data:image/png;base64,@@not base64@@": "not valid base64",
        "data:image/png;base64," + base64.b64encode(b"plain text").decode(): "not an image",
        f"{media}/text": "not an image",
        f"{media}/big": "byte limit",
        "data:image/png;base64," + base64.b64encode(b"\0" * (MAX_BYTES + 10)).decode(): "byte limit",
        f"http://localhost:{media.rsplit(':', 1)[1]}/a.png": "--allowed-media-domains",
        f"{media}/away": "--allowed-media-domains",
        f"{media}/loop": "redirects more than",
        f"{media}/hang": "timed out",
        f"{media}/drip": "timed out",
        f"{media}/missing": "HTTP 404",
        outside.as_uri(): "not under --allowed-local-media-path",
        "ftp://example.com/a.png": "must be an http(s) URL",
    }
    for url, words in cases.items():
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, image_part(url)]}]}
        t0 = time.monotonic()
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 400, (url[:60], r.text)
        err = r.json()["error"]
        assert words in err["message"], (url[:60], err)
        assert err["param"] == "messages[0].content[1].image_url", err
        assert took < FETCH_TIMEOUT_S + 3, (url[:60], took)
    # a third picture is one too many (--limit-mm-per-prompt image 2)
    body = {"model": model, "max_tokens": 2, "messages": ask("hi", *[data_url(IMG_A)] * 3)}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "At most 2 image" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[2].image_url"
    # streaming: the refusal still comes before the stream starts
    body = {**body, "stream": True}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"]


def test_a_text_only_model_refuses_pictures_and_omits_details(tools_client):
    """The session's SmolLM2 tools server (no --enable-prompt-tokens-details): an image
    part is a 400 naming it; usage has no prompt_tokens_details (vLLM: absent without the
    flag)."""
    import openai

    client = tools_client
    model_name = client.models.list().data[0].id

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, max_tokens=2,
                                       messages=ask("hi", data_url(IMG_A)))
    assert "takes text only" in str(e.value)
    r = client.chat.completions.create(model=model_name, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.usage.prompt_tokens_details is None
    assert "prompt_tokens_details" not in json.loads(r.model_dump_json(exclude_unset=True))["usage"]
