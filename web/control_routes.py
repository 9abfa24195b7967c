"""vLLM's operational routes (issue 37), beside the API's:

- POST /reset_prefix_cache[?reset_running_requests=true]: forget every cached prefix block
  (200, empty); 409 while running requests hold blocks, unless reset_running_requests
  preempts them first (they restart by recompute), as vLLM.
- POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (with --enable-sleep-mode): the
  state machine awake -> falling (refusing new requests, letting what runs finish) ->
  asleep -> awake; while not awake every generation request gets 503 `engine_sleeping`.
- GET|POST /ping (SageMaker's, beside /invocations): /health's answer.
- POST /v1/chat/completions/render, /v1/completions/render: what render makes of a request,
  without generating: vLLM's GenerateRequest shape (token_ids, sampling_params, model...),
  one object for chat, a list (one per prompt) for completions; `prompt` adds the text.

Sleep, wake and the reset go to the engine core (EngineClient.control: the one-process
Engine, or a frontend's RemoteEngine over the wire to every engine process).
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import attrs
import orjson
from quart import Response, request

from stages import render as render_stage
from stages.api.common import RequestError
from stages.messages import Submission

if TYPE_CHECKING:
    from pipeline.core.client import EngineClient


def _flag(name: str) -> bool:
    value = request.args.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise RequestError(f"'{name}' must be true or false, got {value!r}.", param=name)
    return value in ("true", "1")


class ControlViews:
    def __init__(self, engine: EngineClient, json_error, health) -> None:
        self.engine = engine
        self._error = json_error
        self._health = health

    async def ping(self) -> Response:
        return await self._health()

    async def reset_prefix_cache(self) -> Response:
        try:
            reset = await self.engine.control("reset_prefix_cache",
                                              reset_running=_flag("reset_running_requests"))
        except RequestError as err:
            return self._error(err)
        if not reset:
            return self._error(RequestError(
                "Prefix cache reset failed: running requests hold KV blocks (retry when idle, "
                "or pass reset_running_requests=true).", status=409, type="conflict_error"))
        return Response(b"", status=200)

    async def sleep(self) -> Response:
        engine = self.engine
        level = request.args.get("level", "1")
        if level not in ("1", "2"):
            return self._error(RequestError(f"'level' must be 1 or 2, got {level!r}.",
                                            param="level"))
        if engine.sleep_state == "asleep":
            return Response(b"", status=200)     # as vLLM: sleeping again changes nothing
        engine.sleep_state = "falling"
        error = await engine.control("sleep", level=int(level))
        if error is not None:
            engine.sleep_state = "awake"
            return self._error(RequestError(f"Could not sleep: {error}", status=500,
                                            type="server_error"))
        engine.sleep_state = "asleep"
        return Response(b"", status=200)

    async def wake_up(self) -> Response:
        engine = self.engine
        if engine.sleep_state == "awake":
            return Response(b"", status=200)
        error = await engine.control("wake_up")
        if error is not None:
            return self._error(RequestError(f"Could not wake up: {error}", status=500,
                                            type="server_error"))
        engine.sleep_state = "awake"
        return Response(b"", status=200)

    async def is_sleeping(self) -> Response:
        return _json({"is_sleeping": self.engine.sleep_state == "asleep"})

    async def render(self, api: str) -> Response:
        """What render makes of the request; nothing runs."""
        try:
            body = orjson.loads(await request.get_data())
        except orjson.JSONDecodeError as exc:
            return self._error(RequestError(f"We could not parse the JSON body of your "
                                            f"request: {exc}"))
        rid = uuid.uuid4().hex
        try:
            rendered = render_stage.render(Submission(rid, api, body, time.monotonic()),
                                           self.engine.render_context)
        except RequestError as err:
            return self._error(err)
        prompts = rendered.prompts or (rendered.prompt_token_ids,)
        limits = rendered.prompt_max_tokens or (rendered.sampling.max_tokens,)
        tok = self.engine.render_context.tokenizer
        out = [_generate_request(rendered, f"{rid}-{i}" if len(prompts) > 1 else rid, ids,
                                 limit, tok)
               for i, (ids, limit) in enumerate(zip(prompts, limits))]
        return _json(out[0] if api == "chat" else out)


def _generate_request(r, rid: str, ids: tuple[int, ...], max_tokens: int, tok) -> dict:
    """vLLM's GenerateRequest (its disaggregated serving's tokens-in request) for one prompt."""
    sp = r.sampling
    opts = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
            for k, v in attrs.asdict(sp.options).items()}
    params = {"n": r.n, **opts, "max_tokens": max_tokens, "stop": list(sp.stop),
              "ignore_eos": sp.ignore_eos,
              "include_stop_str_in_output": sp.include_stop_str_in_output,
              "skip_special_tokens": sp.skip_special_tokens,
              "prompt_logprobs": sp.prompt_logprobs}
    return {"request_id": rid, "token_ids": list(ids), "features": None,
            "sampling_params": params, "model": r.model, "stream": r.stream,
            "stream_options": None, "cache_salt": r.cache_salt, "priority": r.priority,
            "kv_transfer_params": None,
            "prompt": tok.decode(list(ids), skip_special_tokens=False) if tok is not None else None}


def _json(value: object) -> Response:
    return Response(orjson.dumps(value), content_type="application/json")


def add_control_routes(app, views: ControlViews, *, sleep_mode: bool) -> None:
    app.add_url_rule("/ping", view_func=views.ping, methods=["GET", "POST"])
    app.add_url_rule("/reset_prefix_cache", view_func=views.reset_prefix_cache, methods=["POST"])
    if sleep_mode:
        app.add_url_rule("/sleep", view_func=views.sleep, methods=["POST"])
        app.add_url_rule("/wake_up", view_func=views.wake_up, methods=["POST"])
        app.add_url_rule("/is_sleeping", view_func=views.is_sleeping, methods=["GET"])
    for path, api in (("/v1/chat/completions/render", "chat"),
                      ("/v1/completions/render", "completions")):
        async def view(api: str = api) -> Response:
            return await views.render(api)
        app.add_url_rule(path, endpoint=path, view_func=view, methods=["POST"])
