"""detokenize: sampled token ids -> text deltas; stop strings.

One DetokState per request: an incremental decoder (tokenizers' DecodeStream, which
holds back incomplete UTF-8) and the stop-string matcher, which holds back the last
len(longest stop) - 1 characters so that a stop string split across steps is never
half-emitted.
"""
from __future__ import annotations

import attrs
import trio
from tokenizers.decoders import DecodeStream

from stages.render import RenderedRequest
from stages.schedule import FinishRequest, ScheduledStep, SeqUpdate

_PROMPT_CONTEXT = 4  # prompt tokens fed to the decoder first, for correct leading spaces


@attrs.frozen
class TokenLogprob:
    """One output token's logprob with its text, and the top alternatives with theirs."""
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


@attrs.frozen
class TextDelta:
    request_id: str
    text: str
    token_ids: tuple[int, ...]          # tokens counted as output (after a stop string: none)
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class DetokenizedStep:
    step: int
    new_requests: tuple[RenderedRequest, ...]
    deltas: tuple[TextDelta, ...]


class DetokState:
    def __init__(self, req: RenderedRequest, detokenize: bool = True) -> None:
        sp = req.sampling
        self.stream = DecodeStream(ids=list(req.prompt_token_ids[-_PROMPT_CONTEXT:]),
                                   skip_special_tokens=sp.skip_special_tokens) if detokenize else None
        self.stops = sp.stop
        self.include_stop = sp.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""   # decoded text not yet emitted: at most `hold` characters between steps

    def step(self, tokenizer, u: SeqUpdate) -> TextDelta:
        ids = u.token_ids
        # A stop token counts as output; it is shown only when it is one of stop_token_ids
        # and include_stop_str_in_output asks for it (EOS never is), as in vLLM.
        hide_last = (u.finish_reason == "stop" and ids
                     and not (self.include_stop and u.stop_reason is not None))
        for t in (ids[:-1] if hide_last else ids) if self.stream is not None else ():
            piece = self.stream.step(tokenizer, t)
            if piece:
                self.pending += piece
        finish, stop_reason = u.finish_reason, u.stop_reason
        if self.stops and finish != "abort":
            # A stop string cannot start in text already emitted: that text ended at least
            # `hold` characters before the end, so any stop string through it ended too.
            hit = self._find_stop()
            if hit is not None:
                pos, s = hit
                self.pending = self.pending[:pos + len(s) if self.include_stop else pos]
                finish, stop_reason = "stop", s
        cut = len(self.pending) if finish is not None else max(0, len(self.pending) - self.hold)
        delta, self.pending = self.pending[:cut], self.pending[cut:]
        logprobs = tuple(
            TokenLogprob(token_text(tokenizer, t), lp.logprob,
                         tuple((token_text(tokenizer, i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))
            for t, lp in zip(ids, u.logprobs))
        return TextDelta(u.request_id, delta, ids, finish, stop_reason, u.num_cached_tokens, u.error,
                         logprobs)

    def _find_stop(self) -> tuple[int, str] | None:
        best = None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


class Detokenizer:
    """The pure core: per-request states, one ScheduledStep in, one DetokenizedStep out.
    With no tokenizer (a model served from token ids only) deltas carry tokens, no text."""

    def __init__(self, tokenizer) -> None:
        self.hf = tokenizer.hf if hasattr(tokenizer, "hf") else tokenizer
        self.states: dict[str, DetokState] = {}

    def process(self, msg: ScheduledStep) -> tuple[DetokenizedStep, list[str]]:
        """Returns the step's deltas and the requests that a stop string finished."""
        for req in msg.new_requests:
            self.states[req.request_id] = DetokState(req, self.hf is not None)
        deltas, stopped = [], []
        for u in msg.updates:
            st = self.states.get(u.request_id)
            if st is None:
                continue  # already finished here (a stop string), the scheduler catching up
            d = st.step(self.hf, u)
            if d.finish_reason is not None:
                del self.states[u.request_id]
                if u.finish_reason is None:
                    stopped.append(u.request_id)
            deltas.append(d)
        return DetokenizedStep(msg.step, msg.new_requests, tuple(deltas)), stopped


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              control: trio.MemorySendChannel, core: Detokenizer, log=None) -> None:
    async with receive, send, control:
        async for msg in receive:
            out, stopped = core.process(msg)
            for rid in stopped:
                if log is not None:
                    log("stop_string", request_id=rid)
                control.send_nowait(FinishRequest(rid))  # the inbox is sized so this never blocks
            await send.send(out)
