"""What web holds of an engine (`EngineClient`): submit a request and read its Reply,
abort it, tokenize, drain (the stats for /metrics: each subclass's `fetch_stats`). Torch-free, so that a frontend process
(pipeline/layouts/frontend.py) holds one over the wire while the in-process `Engine`
(pipeline/core/engine.py) holds the stages themselves: web cannot tell them apart.

Each request's reply channel lives here (`replies`, stages/replies.py) on the side of
the process that serves its HTTP request; render sends refusals on it and emit its bytes.
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from pipeline.core.reply import Reply, describe
from stages import render
from stages.admit import Accepted
from stages.messages import Abort, Submission
from stages.render import RenderContext, RequestError
from stages.replies import Replies

if TYPE_CHECKING:
    from pipeline.core.events import EventLog
    from stages.api.tokenize import DetokenizeResponse, TokenizeResponse


class AdmissionGate(Protocol):
    """What a client asks before render spends work on a request: stages.admit.Admission
    in one process, a frontend's LocalAdmission (the engine process's admit decides the rest)."""
    draining: bool

    def refusal(self) -> RequestError | None:
        """What any new request would get now (overload, shutdown), or None."""
        ...


@attrs.define(kw_only=True, eq=False)
class EngineClient:
    """The engine as web sees it. `admission` answers `refusal()` (what any new request
    would get now) and holds `draining`; `schedule_in` takes the Aborts (in-process:
    schedule's inbox; in a frontend: the wire to the engine process)."""

    model_names: tuple[str, ...]
    max_model_len: int
    replies: Replies
    admission: AdmissionGate
    render_in: trio.MemorySendChannel       # web -> render
    render_context: RenderContext           # what tokenize and detokenize use
    schedule_in: trio.MemorySendChannel     # aborts -> schedule's inbox
    event_log: EventLog | None = None       # --event-log (web/server.py adds the API keys to hide)
    failure: BaseException | None = None    # the engine has stopped
    # sleep mode (--enable-sleep-mode, pipeline/core/engine.py): "awake", "falling" (asked to
    # sleep, waiting for what runs to finish) or "asleep"; new requests are refused unless awake
    sleep_mode: bool = False
    sleep_state: str = "awake"

    @property
    def healthy(self) -> bool:
        """Running and taking requests (/health): not stopped, not draining."""
        return self.failure is None and not self.admission.draining

    async def submit(self, api: str, body: object, request_id: str | None = None,
                     headers: tuple[tuple[str, str], ...] = ()) -> Reply:
        """Render and admit one request. Raises RequestError before anything is streamed.

        A request that admission would refuse whatever it asks (overload, shutdown) is
        refused here at once, before render spends any work on it."""
        refusal = self._stopped_error() or self._asleep_error() or self.admission.refusal()
        if refusal is not None:
            raise refusal
        rid = request_id or uuid.uuid4().hex
        if rid in self.replies:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        receive = self.replies.open(rid)
        accepted = False
        try:
            try:
                await self.render_in.send(Submission(rid, api, body, time.monotonic(), headers))
                first = await receive.receive()
            except (trio.EndOfChannel, trio.BrokenResourceError):  # the engine stopped meanwhile
                raise self._stopped_error() from None
            if isinstance(first, RequestError):
                raise first
            assert isinstance(first, Accepted), first
            accepted = True
            return Reply(self, rid, first.stream, receive)
        finally:
            if not accepted:  # refused (already released), or cancelled on the way in
                self.abort(rid)

    def tokenize(self, body: object) -> TokenizeResponse:
        """POST /tokenize: the prompt's token ids as render would make them, at once (no
        engine step). Raises RequestError."""
        return render.tokenize(body, self.render_context)

    def detokenize(self, body: object) -> DetokenizeResponse:
        """POST /detokenize: token ids back to text, at once. Raises RequestError."""
        return render.detokenize(body, self.render_context)

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info. Raises RequestError."""
        return render.tokenizer_info(self.render_context)

    @property
    def load(self) -> int:
        """GET /load: the requests in flight (admitted, their replies not yet all sent)."""
        return self.replies.num_admitted

    def _stopped_error(self) -> RequestError | None:
        if self.failure is None:
            return None
        return RequestError(f"The engine stopped: {describe(self.failure)}", status=503,
                            type="server_error", code="engine_stopped")

    def _asleep_error(self) -> RequestError | None:
        if self.sleep_state == "awake":
            return None
        return RequestError("The engine is asleep (POST /sleep): POST /wake_up first.", status=503,
                            type="server_unavailable", code="engine_sleeping")

    async def control(self, op: str, **kw) -> object:
        """An operation on the engine core (stages.messages.Control): the one-process
        Engine sends it to schedule's inbox, a frontend's RemoteEngine over the wire to
        every engine process."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """The client is gone. Its request keeps its admission slot until emit releases it."""
        self.replies.detach(request_id)
        self._abort(request_id, None)

    def _abort(self, request_id: str, error: str | None) -> None:
        # Only an admitted request is known to schedule, and each gets one Abort at most:
        # schedule's inbox is sized for that (see pipeline/core/engine.py _start), so this never
        # blocks. A request not admitted yet is dropped by admit once its reply is detached.
        if not self.replies.mark_aborted(request_id):
            return
        try:
            self.schedule_in.send_nowait(Abort(request_id, error))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the engine is shutting down

    # -- shutdown (web/server.py drives it) ---------------------------------------------------
    def begin_drain(self) -> None:
        """Take no new request (503, and /health 503); those in flight run on."""
        self.admission.draining = True

    def abort_all(self, message: str) -> None:
        """End every admitted request now with `message` as an in-band error (an error
        chunk and [DONE], or a 500 body); schedule frees their blocks with its next step."""
        for rid in self.replies.admitted_ids():
            self._abort(rid, message)

    async def wait_idle(self) -> None:
        """Until no request is in flight (every reply's last byte handed to its reader)."""
        await self.replies.wait_empty()

    def stop(self, exc: BaseException) -> None:
        """The engine stopped: refuse everything from now on and end every reply with an error."""
        self.failure = exc
        self.replies.close_all()

