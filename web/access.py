"""Access control at the ASGI edge: API keys and CORS, outside the Quart app.

Both wrap the ASGI callable, so they see every request before routing and answer without
reading its body:

    CORS (only with --allowed-origins)  ->  API key (only with a key)  ->  the app

CORS sits outside so that a browser's preflight (an OPTIONS without credentials) is
answered without a key and a 401 still carries the CORS headers the browser needs to
read it. The CORS rules are Starlette's CORSMiddleware, the one vLLM installs, with
vLLM's flags and defaults.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Sequence

import orjson

from stages.api.anthropic import error_dict
from stages.api.common import RequestError

API_KEY_ENVS = ("TAILRACE_API_KEY", "VLLM_API_KEY")
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def api_keys(flag: Sequence[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The keys to require: --api-key, else TAILRACE_API_KEY, else VLLM_API_KEY."""
    if flag:
        return tuple(flag)
    for name in API_KEY_ENVS:
        if environ.get(name):
            return (environ[name],)
    return ()


def is_messages_path(path: str) -> bool:
    """Anthropic's Messages API (/v1/messages and below): its errors are Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _header(scope: dict, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return b""


async def send_error(send: Callable, err: RequestError, headers: Sequence[tuple[bytes, bytes]] = (),
                     *, path: str = "") -> None:
    """An error as a whole ASGI response: OpenAI's shape, Anthropic's under /v1/messages."""
    body = error_dict(err) if is_messages_path(path) else err.to_dict()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


def require_api_key(app: Callable, keys: Sequence[str]) -> Callable:
    """Every path but OPEN_PATHS needs ``Authorization: Bearer KEY`` (or, as Anthropic's
    clients send it, ``x-api-key: KEY``) with one of `keys`.

    Each given token is compared with every key in constant time (hmac.compare_digest),
    so neither which key nor how much of one matched shows in the timing. Neither the
    given token nor a key ever goes into a reply or a log line."""
    expected = [key.encode() for key in keys]

    def authorized(scope: dict) -> bool:
        scheme, _, token = _header(scope, b"authorization").partition(b" ")
        token = token.strip()
        bearer = [hmac.compare_digest(token, key) for key in expected]   # no short-circuit
        other = _header(scope, b"x-api-key").strip()
        x_api_key = [hmac.compare_digest(other, key) for key in expected]
        return (scheme.lower() == b"bearer" and any(bearer)) or (bool(other) and any(x_api_key))

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not authorized(scope):
            err = RequestError("Missing or invalid API key: send 'Authorization: Bearer <key>' "
                               "or 'x-api-key: <key>'.", status=401, code="invalid_api_key")
            await send_error(send, err, [(b"www-authenticate", b"Bearer")], path=scope["path"])
            return
        await app(scope, receive, send)

    return guarded


def allow_cors(app: Callable, *, origins: Sequence[str], methods: Sequence[str] = ("*",),
               headers: Sequence[str] = ("*",), credentials: bool = False) -> Callable:
    """vLLM's CORS: Starlette's middleware with --allowed-origins/-methods/-headers and
    --allow-credentials (vLLM's defaults: every method and header)."""
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(app, allow_origins=list(origins), allow_methods=list(methods),
                          allow_headers=list(headers), allow_credentials=credentials)
