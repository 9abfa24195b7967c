"""Access: API keys, CORS, the request body limit, prompt logging; the serve flags."""
from __future__ import annotations

import logging

import httpx
import pytest
import trio

from tests.support.live_servers import served
from web import cli
from web.access import api_keys
from web.app import AppConfig

KEY, OTHER = "sk-first-5b0d", "sk-second-a7e2"
ORIGIN = "https://app.example"


async def test_api_keys_guard_everything_but_health_metrics_and_version(smollm):
    async with served(smollm, AppConfig(api_keys=(KEY, OTHER))) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"prompt": "Hi", "max_tokens": 1}
            for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
                r = await http.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert KEY not in r.text and "sk-nope" not in r.text
            for key in (KEY, OTHER):
                r = await http.post("/v1/completions", json=body,
                                    headers={"Authorization": f"bearer {key}"})
                assert r.status_code == 200
            for path in ("/v1/models", "/tokenize", "/detokenize", "/v2/anything"):
                assert (await http.get(path)).status_code == 401
            for path in ("/health", "/metrics", "/version"):
                assert (await http.get(path)).status_code == 200


def test_api_key_flag_then_environment():
    env = {"TAILRACE_API_KEY": "from-tailrace", "VLLM_API_KEY": "from-vllm"}
    assert api_keys(["flag"], env) == ("flag",)
    assert api_keys(None, env) == ("from-tailrace",)
    assert api_keys(None, {"VLLM_API_KEY": "from-vllm"}) == ("from-vllm",)
    assert api_keys(None, {}) == ()
    assert KEY not in repr(AppConfig(api_keys=(KEY,)))


async def test_no_cors_headers_unless_asked(smollm):
    async with served(smollm) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.get("/v1/models", headers={"Origin": ORIGIN})
            assert not [h for h in r.headers if h.startswith("access-control-")]
            r = await http.options("/v1/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
            assert "access-control-allow-origin" not in r.headers


async def test_cors_as_vllm_with_a_key(smollm):
    config = AppConfig(api_keys=(KEY,), allowed_origins=(ORIGIN,), allow_credentials=True)
    async with served(smollm, config) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # a browser's preflight carries no credentials: answered without the key
            r = await http.options("/v1/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == ORIGIN
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "authorization, content-type"
            assert r.headers["access-control-allow-credentials"] == "true"
            r = await http.get("/v1/models", headers={"Origin": ORIGIN,
                                                      "Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
            r = await http.get("/v1/models", headers={"Origin": ORIGIN})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
            r = await http.get("/v1/models", headers={"Origin": "https://evil.example",
                                                      "Authorization": f"Bearer {KEY}"})
            assert "access-control-allow-origin" not in r.headers


async def test_a_body_over_the_limit_gets_413_without_being_read(smollm):
    async with served(smollm, AppConfig(max_request_body_bytes=1024)) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        # Content-Length says 100 MB; only a few bytes follow: the 413 must not wait for more
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n"
                                      b"content-type: application/json\r\n"
                                      b"content-length: 100000000\r\n\r\n{\"prompt\": \"")
                reply = b""
                while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                    reply += await stream.receive_some()
        assert reply.startswith(b"HTTP/1.1 413")
        assert b'"type":"invalid_request_error"' in reply and b"1024 bytes" in reply
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async def chunks():                       # no Content-Length: counted as it comes
                for _ in range(64):
                    yield b" " * 100
            r = await http.post("/v1/completions", content=chunks())
            assert r.status_code == 413
            ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert ok.status_code == 200


async def test_max_log_len_caps_the_prompt_in_the_log_line(smollm, caplog):
    config = AppConfig(enable_log_requests=True, max_log_len=20)
    async with served(smollm, config) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with caplog.at_level(logging.INFO, logger="tailrace.web"):
                r = await http.post("/v1/completions", json={"prompt": "word " * 20,
                                                             "max_tokens": 1})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tailrace.web"]
    shown = len('{"prompt":"' + "word " * 20 + '"}') - 20
    assert len(lines) == 1 and lines[0].endswith(f'{{"prompt":"word word... ({shown} more characters)')


def test_serve_flags():
    parser = cli.build_parser(with_bench=False)
    args = parser.parse_args(["serve", "--max-waiting", "7", "--allowed-origins",
                              '["https://a.example", "https://b.example"]', "--allowed-methods",
                              "GET,POST", "--max-request-body-bytes", "1MiB", "--api-key", "k1",
                              "k2", "--graceful-timeout", "3"])
    assert args.max_queued_requests == 7
    assert cli.engine_config(args).max_queued_requests == 7
    config = cli.app_config(args)
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert config.allowed_methods == ("GET", "POST") and config.allowed_headers == ("*",)
    assert config.max_request_body_bytes == 1 << 20 and config.api_keys == ("k1", "k2")
    args = parser.parse_args(["serve", "--max-queued-requests", "9"])
    assert args.max_queued_requests == 9 and cli.app_config(args).allowed_origins == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--allowed-origins", '["a", 1]'])
