"""The async shell around one streamed request: send, parse, account."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson

from web.bench.account import RequestResult, StreamAccount, failed_result
from web.bench.backends import Backend, error_message
from web.bench.sse import SSEEvent, SSEParser
from web.bench.transport import StreamClient


def request_headers(request_id: str, extra: dict[str, str]) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "x-request-id": request_id}
    headers.update(extra)
    return headers


def _http_error(status: int, body: bytes) -> str:
    message = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and "error" in parsed:
        message = error_message(parsed["error"])
    elif isinstance(parsed, dict) and "message" in parsed:
        message = str(parsed["message"])
    return f"HTTP {status}: {message[:500]}"


async def send_request(client: StreamClient | httpx.AsyncClient, backend: Backend, url: str,
                       payload: dict[str, Any], headers: dict[str, str], prompt_len: int) -> RequestResult:
    """Stream one request and account for it; never raises for server or transport failures."""
    start_ns = time.perf_counter_ns()
    account = StreamAccount(prompt_len=prompt_len, start_ns=start_ns)
    parser = SSEParser()
    content = orjson.dumps(payload)
    response_started = False
    try:
        async with client.stream("POST", url, content=content, headers=headers) as response:
            response_started = True
            if response.status_code != 200:
                body = await response.aread()
                return failed_result(prompt_len, _http_error(response.status_code, body), start_ns)
            if not backend.stream:      # one JSON body (embeddings)
                body = await response.aread()
                account.observe(backend.interpret(SSEEvent(body.decode("utf-8", errors="replace"))),
                                time.perf_counter_ns())
                return account.finish()
            async for chunk in response.aiter_bytes():
                now_ns = time.perf_counter_ns()
                for event in parser.feed(chunk):
                    account.observe(backend.interpret(event), now_ns)
                if parser.saw_done:
                    account.mark_terminal()
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if not response_started:
            return failed_result(prompt_len, reason, start_ns)
        return account.finish(transport_error=reason)
    return account.finish()
