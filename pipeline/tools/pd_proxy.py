"""The P/D proxy of `tailrace cluster --prefill N --decode M` (issue 36): one OpenAI
endpoint in front of prefill and decode instances, running vLLM's disaggregated-serving
flow (its toy proxy's) for /v1/chat/completions and /v1/completions:

    1. the request to a prefill instance, with max_tokens 1, stream off and
       kv_transfer_params {"do_remote_decode": true}; its reply's kv_transfer_params name
       the blocks it now holds (stages/kv_transfer.py);
    2. the request as the client sent it to a decode instance, with those params: its
       reply (streamed or not) goes to the client as it comes.

A refusal of step 1 goes to the client as it is (the prefill instance's status and
error body). Instances are picked round robin, each role on its own. Every other path
(/v1/models, /tokenize, ...) goes to a decode instance. /health is 200 while at least
one instance of each role is in; the cluster launcher takes a dead one out and puts it
back (`POST /remove_worker?url=U`, `/add_worker?url=U`, vllm-router's endpoints).

    python -m pipeline.tools.pd_proxy --host H --port P --prefill URL... --decode URL...
"""
from __future__ import annotations

import argparse
import itertools
import logging

import httpx
import trio

log = logging.getLogger("tailrace.pd_proxy")

GENERATE = ("/v1/chat/completions", "/v1/completions")
TIMEOUT = httpx.Timeout(None, connect=10.0)
_HOP = {"host", "content-length", "transfer-encoding", "connection"}


def prefill_body(body: dict) -> dict:
    """Step 1's request: one token, no stream, the prefill side's params."""
    out = {k: v for k, v in body.items()
           if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens")}
    out.update(max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None})
    return out


class Pool:
    """One role's instances, round robin over those in."""

    def __init__(self, urls) -> None:
        self.urls = list(urls)
        self.out: set[str] = set()
        self._turn = itertools.count()

    def pick(self) -> str | None:
        live = [u for u in self.urls if u not in self.out]
        return live[next(self._turn) % len(live)] if live else None


def make_app(prefill: Pool, decode: Pool):
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio("tailrace-pd-proxy")
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024
    http = httpx.AsyncClient(timeout=TIMEOUT)

    def error(status: int, message: str) -> Response:
        import json
        return Response(json.dumps({"error": {"message": message, "type": "server_error",
                                              "param": None, "code": status}}),
                        status=status, content_type="application/json")

    def headers() -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}

    async def forward(url: str, path: str, method: str, content: bytes | None = None,
                      json_body: dict | None = None) -> Response:
        req = http.build_request(method, url + path, headers=headers(), content=content,
                                 json=json_body, params=request.args)
        try:
            upstream = await http.send(req, stream=True)
        except httpx.TransportError as exc:
            return error(502, f"the instance at {url} did not answer: {exc}")

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        return Response(body(), status=upstream.status_code, headers=kept)

    @app.route("/health", methods=["GET"])
    async def health():
        if prefill.pick() is None or decode.pick() is None:
            return error(503, "no prefill or no decode instance is in")
        return Response("", status=200)

    @app.route("/remove_worker", methods=["POST"])
    @app.route("/add_worker", methods=["POST"])
    async def workers():
        url = request.args.get("url", "")
        pools = [p for p in (prefill, decode) if url in p.urls]
        if not pools:
            return error(404, f"{url!r} is no instance of this proxy")
        for p in pools:
            (p.out.add if request.path == "/remove_worker" else p.out.discard)(url)
        return Response("", status=200)

    async def generate(path: str):
        body = await request.get_json(force=True, silent=True)
        if not isinstance(body, dict):       # the decode instance answers the 400 itself
            url = decode.pick()
            return (error(503, "no decode instance is in") if url is None else
                    await forward(url, path, "POST", content=await request.get_data()))
        p_url, d_url = prefill.pick(), decode.pick()
        if p_url is None or d_url is None:
            return error(503, "no prefill or no decode instance is in")
        try:
            r = await http.post(p_url + path, json=prefill_body(body), headers=headers())
        except httpx.TransportError as exc:
            return error(502, f"the prefill instance at {p_url} did not answer: {exc}")
        if r.status_code != 200:
            return Response(r.content, status=r.status_code,
                            content_type=r.headers.get("content-type", "application/json"))
        params = r.json().get("kv_transfer_params")
        if not params:
            return error(502, f"the prefill instance at {p_url} returned no kv_transfer_params "
                              "(is it started with --kv-transfer-config?)")
        return await forward(d_url, path, "POST", json_body={**body, "kv_transfer_params": params})

    def route(path: str):
        async def view():
            return await generate(path)
        return view

    for path in GENERATE:
        app.add_url_rule(path, f"generate{path}", route(path), methods=["POST"])

    @app.route("/<path:rest>", methods=["GET", "POST", "DELETE"])
    async def other(rest: str):
        url = decode.pick()
        if url is None:
            return error(503, "no decode instance is in")
        return await forward(url, "/" + rest, request.method, content=await request.get_data())

    return app


async def serve(host: str, port: int, prefill: list[str], decode: list[str]) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = log
    await hypercorn_serve(make_app(Pool(prefill), Pool(decode)), config)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.pd_proxy")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    trio.run(serve, args.host, args.port, args.prefill, args.decode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
