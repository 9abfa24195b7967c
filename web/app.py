"""The HTTP edge: a Quart (quart-trio) app over an Engine.

Routes: POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and
/v1/messages/count_tokens (Anthropic's), /invocations (SageMaker's); GET/DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel
(stored Responses, web/responses_routes.py); /tokenize, /detokenize; GET /v1/models, /v1/models/{id}, /health, /load,
/metrics, /version, /tokenizer_info (with --enable-tokenizer-info-endpoint); under
--root-path as well. Until the model has loaded, LoadingGate answers every request with 503. Every error is OpenAI-shaped JSON; every
503 (overload, shutdown, a stopped engine) carries Retry-After. API keys and CORS wrap
the app at the ASGI level (web/access.py); AppConfig holds the server's own settings.

Disconnect is cancellation: when the client goes away quart-trio cancels the
request's task; the SSE generator's `finally` (and, as a net for a reply whose
body never started, the ASGI guard below) closes the Reply, which aborts the
request and frees its KV blocks.
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import orjson
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pipeline.core.validators import non_negative, positive
from stages.api import APIS
from stages.api import anthropic
from stages.api.common import RequestError, parse_request, unstructure
from stages.render import has_images
from stages.api.pooling import INVOCATION_INPUT, INVOCATION_MESSAGES, ROUTES as POOLING_ROUTES
from web import access, lora_routes
from web.control_routes import ControlViews, add_control_routes
from web.metrics import EngineCollector
from web.responses_routes import StatefulResponses
from web.responses_store import DEFAULT_MAX_ITEMS, open_store
from web.sse import direct_body

if TYPE_CHECKING:     # the app is imported without the engine (torch)
    from pipeline.core.engine import Engine
    from pipeline.core.reply import Reply

log = logging.getLogger("tailrace.web")

_API_ROUTES = {spec.path: name for name, spec in APIS.items()} | POOLING_ROUTES
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_REPLIES_KEY = "tailrace.replies"
_PROMPT_FIELDS = ("messages", "prompt", "input")      # what a request log line shows
RETRY_AFTER_S = 1
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20


@attrs.frozen
class AppConfig:
    """The HTTP server's own settings (the engine's are pipeline.core.config.EngineConfig)."""
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, repr=False)
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # (): no CORS
    allowed_methods: tuple[str, ...] = attrs.field(default=("*",), converter=tuple)
    allowed_headers: tuple[str, ...] = attrs.field(default=("*",), converter=tuple)
    allow_credentials: bool = False
    max_request_body_bytes: int = attrs.field(default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                                              validator=positive)
    enable_log_requests: bool = False
    max_log_len: int | None = attrs.field(default=None, validator=non_negative)
    # behind a proxy that serves the API under a prefix: /PREFIX/v1/... is /v1/... (and
    # /v1/... still works), as vLLM's --root-path
    root_path: str = attrs.field(default="", converter=lambda p: (p or "").rstrip("/"))
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (shows the template)
    # stored Responses (web/responses_store.py): an SQLite file, else memory; LRU bound
    responses_store: str | None = None
    responses_store_max_items: int = attrs.field(default=DEFAULT_MAX_ITEMS, validator=positive)

    @root_path.validator
    def _root_path(self, attribute, value: str) -> None:
        if value and not value.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {value!r}")


def error_response(message: str, status: int, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   request_id: str | None = None) -> Response:
    return _json_error(RequestError(message, status=status, type=type, param=param, code=code),
                       request_id)


def _json_error(err: RequestError, request_id: str | None = None,
                api: str | None = None) -> Response:
    """The error as JSON: in the shape of `api` (APIS), else of the path's API (Anthropic's
    under /v1/messages), else OpenAI's."""
    headers = {"x-request-id": request_id} if request_id else {}
    if err.status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if api is None and access.is_messages_path(request.path):
        api = "messages"
    body = APIS[api].error_body(err) if api in APIS else err.to_dict()
    return Response(orjson.dumps(body), status=err.status,
                    content_type="application/json", headers=headers)


def _prompt_preview(body: object, max_len: int | None) -> str:
    """The prompt part of a request body for a log line, cut to max_len characters."""
    if not isinstance(body, dict):
        return "(not an object)"
    text = orjson.dumps({k: body[k] for k in _PROMPT_FIELDS if k in body}).decode()
    if max_len is not None and len(text) > max_len:
        return f"{text[:max_len]}... ({len(text) - max_len} more characters)"
    return text


def _data_parallel_rank(value: str, size: int) -> int:
    """X-data-parallel-rank's rank, checked against --data-parallel-size (400 otherwise)."""
    try:
        rank = int(value.strip())
    except ValueError:
        rank = -1
    if not 0 <= rank < size:
        raise RequestError(f"X-data-parallel-rank header: {value[:16]!r} is not a data-parallel "
                           f"rank of this server (0 to {size - 1})", status=400,
                           param="X-data-parallel-rank")
    return rank


def _request_id() -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


async def _close_quietly(reply: Reply) -> None:
    # Runs while the request's scope may be cancelled (a disconnect): shield the
    # abort so it reaches the engine.
    with trio.CancelScope(shield=True):
        await reply.aclose()


def _guard_replies(asgi_app: Callable) -> Callable:
    """ASGI wrapper: whatever ends an HTTP request, close every Reply it opened; and let
    the last body message finish.

    Hypercorn handles that last message all the way down to closing the socket (a
    ``Connection: close`` request, an HTTP/1.0 client) or arming the keep-alive timer,
    and on the way it tells quart-trio the request is over, whose watcher then cancels
    the very task doing it: the socket stayed open until the client gave up, and a client
    reading to the end of a close-delimited stream waited forever. Shielding that one
    message lets it complete (Hypercorn already shields each write of the bytes)."""

    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await asgi_app(scope, receive, send)

        async def send_last_shielded(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        replies: list = []
        scope[_REPLIES_KEY] = replies
        try:
            await asgi_app(scope, receive, send_last_shielded)
        finally:
            for reply in replies:
                await _close_quietly(reply)

    return guarded


def _strip_root_path(asgi_app: Callable, root: str) -> Callable:
    """ASGI wrapper: a path under `root` is served as the path below it (everything inside,
    API keys and CORS included, sees /v1/..., never /ROOT/v1/...)."""
    raw_root = root.encode()

    async def stripped(scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            if path == root or path.startswith(root + "/"):
                raw = scope.get("raw_path") or path.encode()
                scope = {**scope, "path": path[len(root):] or "/",
                         "raw_path": raw[len(raw_root):] if raw.startswith(raw_root) else raw}
        return await asgi_app(scope, receive, send)

    return stripped


def _wrap(asgi_app: Callable, config: AppConfig) -> Callable:
    asgi_app = _guard_replies(asgi_app)
    if config.api_keys:
        asgi_app = access.require_api_key(asgi_app, config.api_keys)
    if config.allowed_origins:
        asgi_app = access.allow_cors(asgi_app, origins=config.allowed_origins,
                                     methods=config.allowed_methods,
                                     headers=config.allowed_headers,
                                     credentials=config.allow_credentials)
    if config.root_path:
        asgi_app = _strip_root_path(asgi_app, config.root_path)
    return asgi_app


class LoadingGate:
    """The ASGI app Hypercorn serves: until `open(app)`, while the model loads, every HTTP
    request gets 503 with Retry-After (GET /health an empty body, the rest an OpenAI error
    with code ``model_loading``), so a router or a Kubernetes probe can tell "loading" from
    "down"; from then on everything goes to `app`.

    The gate answers the ASGI lifespan itself (the app may not exist yet when Hypercorn
    starts): Quart's before_serving/after_serving hooks do not run, and the app has none."""

    def __init__(self) -> None:
        self.app: Callable | None = None
        self.binds: list[str] = []          # where Hypercorn serves it (web.server.open_http)
        self.stop_serving: Callable[[], None] = lambda: None     # set by web.server.open_http

    def open(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-length", b"0"), *retry]})
            await send({"type": "http.response.body", "body": b""})
            return
        err = RequestError("The model is still loading: try again shortly.", status=503,
                           type="server_unavailable", code="model_loading")
        await access.send_error(send, err, retry, path=scope["path"])


def _json(value: object) -> Response:
    return Response(orjson.dumps(value), content_type="application/json")


async def _json_body() -> object:
    """The request's JSON body; a RequestError (400) when it does not parse."""
    try:
        return orjson.loads(await request.get_data())
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"We could not parse the JSON body of your request: {exc}") from None


def _stream_response(reply: Reply, headers: dict[str, str]) -> Response:
    async def sse():
        # Quart sent the head before asking for the body: from here the engine's steps
        # may write this stream's chunks to the socket themselves (web/sse.py DirectBody)
        reply.direct = direct_body()
        try:
            async for chunk in reply:
                yield chunk
        finally:
            await _close_quietly(reply)

    response = Response(sse(), status=200, content_type="text/event-stream",
                        headers={**headers, "Cache-Control": "no-cache",
                                 "X-Accel-Buffering": "no"})
    response.timeout = None     # Quart would cut the stream at 60 s
    return response


class Views:
    """The routes of one app over one running engine, one method each."""

    def __init__(self, engine: Engine, config: AppConfig) -> None:
        self.engine = engine
        self.config = config
        self.started_at = int(time.time())
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = EngineCollector(engine)
        self.registry.register(self.collector)
        self.responses = StatefulResponses(
            open_store(config.responses_store, config.responses_store_max_items), engine,
            keyed=bool(config.api_keys))

    async def generate(self, api: str | None) -> Response:
        """POST /v1/chat/completions, /v1/completions, /v1/responses; POST /invocations
        (SageMaker's; `api` None: the body's shape says which)."""
        request_id = _request_id()
        rank = request.headers.get("X-data-parallel-rank")
        size = getattr(self.engine, "data_parallel_size", 1)
        prepared = None
        try:
            if rank is not None and size > 1:   # vLLM's data-parallel routing: that engine
                self.engine.pin_rank(request_id, _data_parallel_rank(rank, size))
            elif rank is not None:   # one engine serves every rank
                log.info("request %s: X-data-parallel-rank %s (one engine serves all ranks)",
                         request_id, rank[:16])
            body = await _json_body()
            api = api or _invocation_api(body)
            if api == "responses":   # previous_response_id's conversation goes in front
                prepared = await self.responses.prepare(body)
                body = prepared.body if prepared is not None else body
            if self.config.enable_log_requests:
                log.info("request %s (%s): %s", request_id, api,
                         _prompt_preview(body, self.config.max_log_len),
                         extra={"request_id": request_id, "api": api})
            reply = await self.engine.submit(api, body, request_id,
                                             headers=tuple(request.headers.items()))
        except RequestError as err:
            if size > 1:
                self.engine.unpin(request_id)
            return _json_error(err, request_id, api)
        headers = {"x-request-id": reply.request_id}
        if prepared is not None and prepared.background:   # no client holds it: not closed
            return await self.responses.reply(prepared, reply, headers, _close_quietly)
        request.scope[_REPLIES_KEY].append(reply)
        if prepared is not None:     # stored once it ends (unless store: false)
            return await self.responses.reply(prepared, reply, headers, _close_quietly)
        if reply.stream:
            return _stream_response(reply, headers)
        try:
            data = b"".join([chunk async for chunk in reply])
        finally:
            await _close_quietly(reply)
        return Response(data, status=reply.status, content_type="application/json",
                        headers=headers)

    async def tokenize(self) -> Response:
        """POST /tokenize: the engine's tokenizer, run at once (no engine step)."""
        return await self._at_once(self.engine.tokenize)

    async def detokenize(self) -> Response:
        """POST /detokenize."""
        return await self._at_once(self.engine.detokenize)

    async def stored_response(self, response_id: str, action: str = "get") -> Response:
        """GET/DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel."""
        try:
            if action == "get":
                return await (self.responses.get(response_id) if request.method == "GET"
                              else self.responses.delete(response_id))
            if action == "input_items":
                return await self.responses.input_items(response_id)
            return await self.responses.cancel(response_id)
        except RequestError as err:
            return _json_error(err)

    async def count_tokens(self) -> Response:
        """POST /v1/messages/count_tokens: the prompt a Messages request renders, counted by
        the tokenizer at once (through /tokenize's path: same template, tools, kwargs)."""
        try:
            body = anthropic.count_tokens_body(
                await _json_body(), reasoning_parser=self.engine.render_context.reasoning,
                tools=self.engine.render_context.tools, parse=parse_request)
            count = self.engine.tokenize(body).count
        except RequestError as err:
            return _json_error(err, api="messages")
        return _json({"input_tokens": count})

    async def _at_once(self, call: Callable[[object], object]) -> Response:
        try:
            body = await _json_body()
            # pictures are fetched and preprocessed (/tokenize): not on the event loop
            result = (await trio.to_thread.run_sync(call, body) if has_images(body)
                      else call(body))
        except RequestError as err:
            return _json_error(err)
        return _json(unstructure(result))

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started_at,
                "owned_by": "tailrace", "root": name, "parent": None,
                "max_model_len": self.engine.max_model_len}

    async def models(self) -> Response:
        data = [self._model_card(name) for name in self.engine.model_names]
        data += lora_routes.adapter_cards(self.engine, self.started_at)
        return _json({"object": "list", "data": data})

    async def model(self, model_id: str) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve); an id may hold
        slashes (`org/name`)."""
        cards = {c["id"]: c for c in lora_routes.adapter_cards(self.engine, self.started_at)}
        if model_id in cards:
            return _json(cards[model_id])
        if model_id not in self.engine.model_names:
            return error_response(f"The model `{model_id}` does not exist.", 404,
                                  type="NotFoundError", param="model", code="model_not_found")
        return _json(self._model_card(model_id))

    async def health(self) -> Response:
        # 503 once the server drains for shutdown or the engine has stopped
        if self.engine.healthy:
            return Response(b"", status=200)
        return Response(b"", status=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def tokenizer_info(self) -> Response:
        """GET /tokenizer_info (with --enable-tokenizer-info-endpoint, as vLLM)."""
        try:
            return _json(self.engine.tokenizer_info())
        except RequestError as err:
            return _json_error(err)

    async def load(self) -> Response:
        """GET /load: vLLM's server load, the requests in flight."""
        return _json({"server_load": self.engine.load})

    async def version(self) -> Response:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        try:
            v = dist_version("tailrace")
        except PackageNotFoundError:
            v = "unknown"
        return _json({"version": v})

    async def metrics(self) -> Response:
        # in one process the stats are read as they are; a frontend process of
        # --api-server-count asks the engine process, which sums every frontend's
        self.collector.snapshot = await self.engine.fetch_stats()
        try:
            return Response(generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)
        finally:
            self.collector.snapshot = None

    async def http_error(self, exc: HTTPException) -> Response:
        if exc.code == 404:
            message = f"Invalid URL ({request.method} {request.path})."
            kind = "not_found_error"
        elif exc.code == 405:
            message = f"Method not allowed ({request.method} {request.path})."
            kind = "invalid_request_error"
        elif exc.code == 413:
            message = (f"The request body is larger than this server accepts "
                       f"({self.config.max_request_body_bytes} bytes).")
            kind = "invalid_request_error"
        else:
            message = exc.description or exc.name
            kind = "invalid_request_error" if (exc.code or 500) < 500 else "server_error"
        response = error_response(message, exc.code or 500, type=kind)
        if exc.code == 405 and exc.valid_methods:   # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    async def unexpected_error(self, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(f"Internal server error: {type(exc).__name__}", 500,
                              type="server_error")


def _invocation_api(body: object) -> str:
    """SageMaker's /invocations, as vLLM dispatches it: a chat completion request (it has
    `messages`), else a completion request (`prompt`)."""
    if isinstance(body, dict):
        if "messages" in body:    # chat, or on a pooling model embeddings (render decides)
            return INVOCATION_MESSAGES
        if "prompt" in body:
            return "completions"
        if "input" in body:     # an embedding model's embeddings, a classifier's classes
            return INVOCATION_INPUT
        if any(side in body for side in ("text_1", "queries", "data_1")):
            return "score"
        if "query" in body and "documents" in body:
            return "rerank"
    raise RequestError("/invocations takes a chat completion request (with 'messages'), a "
                       "completion request (with 'prompt'), an embeddings or classification "
                       "request (with 'input'), a score request (with 'text_1', 'queries' or "
                       "'data_1') or a rerank request (with 'query' and 'documents').")


def create_app(engine: Engine, config: AppConfig = AppConfig()) -> QuartTrio:
    """The app for one running engine (see pipeline.core.engine.open_engine): the engine
    outlives the app, so serving it neither starts nor stops the engine."""
    app = QuartTrio("tailrace")
    # Quart refuses a larger body with 413 as soon as its Content-Length (or, chunked, the
    # bytes so far) passes the limit, without reading the rest.
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_body_bytes
    app.asgi_app = _wrap(app.asgi_app, config)
    views = Views(engine, config)

    for path, api in _API_ROUTES.items():
        async def view(api: str = api) -> Response:
            return await views.generate(api)
        app.add_url_rule(path, endpoint=path, view_func=view, methods=["POST"])

    async def invocations() -> Response:
        return await views.generate(None)
    app.add_url_rule("/invocations", endpoint="invocations", view_func=invocations,
                     methods=["POST"])

    app.add_url_rule("/v1/messages/count_tokens", view_func=views.count_tokens,
                     methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", view_func=views.stored_response,
                     methods=["GET", "DELETE"])
    app.add_url_rule("/v1/responses/<response_id>/input_items", endpoint="input_items",
                     view_func=views.stored_response, methods=["GET"],
                     defaults={"action": "input_items"})
    app.add_url_rule("/v1/responses/<response_id>/cancel", endpoint="cancel",
                     view_func=views.stored_response, methods=["POST"],
                     defaults={"action": "cancel"})
    app.add_url_rule("/tokenize", view_func=views.tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=views.detokenize, methods=["POST"])
    app.add_url_rule("/v1/models", view_func=views.models, methods=["GET"])
    app.add_url_rule("/v1/models/<path:model_id>", view_func=views.model, methods=["GET"])
    app.add_url_rule("/health", view_func=views.health, methods=["GET"])
    app.add_url_rule("/load", view_func=views.load, methods=["GET"])
    if config.enable_tokenizer_info_endpoint:
        app.add_url_rule("/tokenizer_info", view_func=views.tokenizer_info, methods=["GET"])
    app.add_url_rule("/version", view_func=views.version, methods=["GET"])
    app.add_url_rule("/metrics", view_func=views.metrics, methods=["GET"])
    add_control_routes(app, ControlViews(engine, _json_error, views.health),   # issue 37
                       sleep_mode=getattr(engine, "sleep_mode", False))
    lora_routes.register(app, engine, _json_body, _json_error)
    app.register_error_handler(HTTPException, views.http_error)
    app.register_error_handler(Exception, views.unexpected_error)
    return app
