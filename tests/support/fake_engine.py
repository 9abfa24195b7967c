"""An engine stand-in for the web tests (tests/web): replies scripted by the request body
(streamed or not, hanging, failing), stats, draining; no model."""
from __future__ import annotations

import orjson
import trio

from pipeline.core.stats import EngineStats
from stages.render import RequestError

class FakeReply:
    def __init__(self, request_id: str, stream: bool, chunks: list[bytes], *, status=200,
                 hang=False) -> None:
        self.request_id = request_id
        self.stream = stream
        self.status = 200
        self._final_status = status
        self._chunks = chunks
        self._hang = hang
        self.finished = False
        self.aborted = False
        self.closed = trio.Event()

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        for chunk in self._chunks:
            await trio.sleep(0)
            yield chunk
        if self._hang:
            await trio.sleep_forever()
        self.status = self._final_status
        self.finished = True

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.aborted = True
        self.closed.set()


class FakeEngine:
    model_names = ("fake-model",)
    max_model_len = 64

    def __init__(self) -> None:
        self.replies: list[FakeReply] = []
        self.healthy = True

    def begin_drain(self) -> None:
        self.healthy = False

    async def wait_idle(self) -> None:
        while any(not r.finished for r in self.replies):
            await trio.sleep(0.01)

    def abort_all(self, message: str) -> None:
        for reply in self.replies:
            reply.finished = True

    async def submit(self, api, body, request_id=None, headers=()):
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object.")
        if body.get("model") not in (None, "fake-model"):
            raise RequestError("The model `x` does not exist.", status=404,
                               type="NotFoundError", param="model", code="model_not_found")
        if body.get("boom"):
            raise ZeroDivisionError("bug")
        stream = bool(body.get("stream"))
        if stream:
            chunks = [b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n"]
            if not body.get("hang"):
                chunks.append(b"data: [DONE]\n\n")
        elif body.get("hang"):
            chunks = []
        else:
            chunks = [orjson.dumps({"api": api, "ok": True})]
        reply = FakeReply(request_id, stream, chunks, status=body.get("status", 200),
                          hang=bool(body.get("hang")))
        self.replies.append(reply)
        return reply

    async def fetch_stats(self):   # EngineClient's: /metrics reads it
        return self.stats()

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len([r for r in self.replies if not r.finished]),
                           num_waiting=0, kv_blocks_total=10, kv_blocks_free=10,
                           kv_blocks_used=0, prompt_tokens_total=5, generation_tokens_total=7,
                           requests_finished_total={"stop": 1})
