"""detokenize: sampled token ids -> text deltas; stop strings.

One DetokState per request: an incremental decoder (tokenizers' DecodeStream, which
holds back incomplete UTF-8) and the stop-string matcher, which holds back the last
len(longest stop) - 1 characters so that a stop string split across steps is never
half-emitted. As in vLLM, a stop string only counts when it ends in the text of an
output token past the first min_tokens.
"""
from __future__ import annotations

import attrs
import trio
from tokenizers.decoders import DecodeStream

from stages.delta import Delta, FinishReason, PromptLogprob, TokenLogprob
from stages.render import RenderedRequest
from stages.schedule import FinishRequest, Step

_PROMPT_CONTEXT = 4  # prompt tokens fed to the decoder first, for correct leading spaces
# content starts as the text, what a request without a parser shows, so that parse passes
# such a request's deltas on as they are; parse splits it for a request with one
_with_text = Delta.evolver("text", "content", "logprobs", "finish_reason", "stop_reason")
_with_prompt_logprobs = Delta.evolver("prompt_logprobs")


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


class DetokState:
    def __init__(self, req: RenderedRequest, detokenize: bool = True, index: int = 0) -> None:
        sp = req.sampling
        self.prompt = req.prompt_of(index)
        self.stream = DecodeStream(ids=list(self.prompt[-_PROMPT_CONTEXT:]),
                                   skip_special_tokens=sp.skip_special_tokens) if detokenize else None
        self.stops = sp.stop
        self.include_stop = sp.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.min_tokens = sp.options.min_tokens
        self.num_output = 0  # output tokens seen so far
        self.pending = ""   # decoded text not yet emitted: at most `hold` characters between steps
        # No stop strings: nothing is ever held back, so a running sequence's one new token
        # is just its decoded piece (Detokenizer.process's fast path, most tokens of most steps).
        self.plain = self.stream is not None and not self.stops

    def step(self, tokenizer, d: Delta) -> Delta:
        ids = d.token_ids
        # A stop token counts as output; it is shown only when it is one of stop_token_ids
        # and include_stop_str_in_output asks for it (EOS never is), as in vLLM.
        hide_last = (d.finish_reason == FinishReason.STOP and ids
                     and not (self.include_stop and d.stop_reason is not None))
        # A stop string must end after `check_from`: in this step's text (anything through
        # older text was looked for already), and past the first min_tokens tokens' text.
        check_from = len(self.pending)
        for t in (ids[:-1] if hide_last else ids) if self.stream is not None else ():
            piece = self.stream.step(tokenizer, t)
            if piece:
                self.pending += piece
            self.num_output += 1
            if self.num_output <= self.min_tokens:
                check_from = len(self.pending)
        finish, stop_reason = d.finish_reason, d.stop_reason
        if self.stops and finish != FinishReason.ABORT:
            hit = self._find_stop(check_from)
            if hit is not None:
                pos, s = hit
                self.pending = self.pending[:pos + len(s) if self.include_stop else pos]
                finish, stop_reason = FinishReason.STOP, s
        cut = len(self.pending) if finish is not None else max(0, len(self.pending) - self.hold)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        logprobs = tuple(
            TokenLogprob(token_text(tokenizer, t), lp.logprob,
                         tuple((token_text(tokenizer, i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))
            for t, lp in zip(ids, d.token_logprobs))
        out = _with_text(d, text, text, logprobs, finish, stop_reason)
        if d.prompt_token_logprobs:
            out = _with_prompt_logprobs(out, self.prompt_logprobs(tokenizer, d.prompt_token_logprobs))
        return out

    def prompt_logprobs(self, tokenizer, raw) -> tuple[PromptLogprob, ...]:
        """The prompt's logprobs with their tokens' text: entry i is prompt token i's (the
        first has none)."""
        return tuple(
            PromptLogprob(t, token_text(tokenizer, t), None) if lp is None else PromptLogprob(
                t, token_text(tokenizer, t), lp.logprob, lp.rank,
                tuple((i, token_text(tokenizer, i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))
            for t, lp in zip(self.prompt, raw))

    def _find_stop(self, check_from: int) -> tuple[int, str] | None:
        """The earliest stop string in pending that ends after check_from."""
        best = None
        for s in self.stops:
            i = self.pending.find(s, max(0, check_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


class Detokenizer:
    """The pure core: per-request states, one Step in, the same Step with text out.
    With no tokenizer (a model served from token ids only) deltas carry tokens, no text."""

    def __init__(self, tokenizer) -> None:
        self.hf = tokenizer.hf if hasattr(tokenizer, "hf") else tokenizer
        self.states: dict[tuple[str, int], DetokState] = {}   # (request id, choice)

    def process(self, msg: Step) -> tuple[Step, list[tuple[str, int]]]:
        """Returns the step's deltas and the (request, choice) a stop string finished."""
        for req in msg.new_requests:
            for i in range(req.num_choices):
                self.states[req.request_id, i] = DetokState(req, self.hf is not None, i)
        deltas, stopped = [], []
        hf, states = self.hf, self.states
        for d in msg.deltas:
            key = (d.request_id, d.index)
            st = states.get(key)
            if st is None:
                continue  # already finished here (a stop string), the scheduler catching up
            ids = d.token_ids
            if (st.plain and d.finish_reason is None and len(ids) == 1 and not d.token_logprobs
                    and not d.prompt_token_logprobs):
                piece = st.stream.step(hf, ids[0]) or ""
                st.num_output += 1
                deltas.append(_with_text(d, piece, piece, (), None, None))
                continue
            out = st.step(hf, d)
            if out.finished:
                del self.states[key]
                if not d.finished:
                    stopped.append(key)
            deltas.append(out)
        return attrs.evolve(msg, deltas=tuple(deltas)), stopped


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
              control: trio.MemorySendChannel, core: Detokenizer, log=None) -> None:
    async with receive, send, control:
        async for msg in receive:
            out, stopped = core.process(msg)
            if log is not None:
                log("detokenized", step=out.step, deltas=out.deltas)
            for rid, index in stopped:
                if log is not None:
                    log("stop_string", request_id=rid, index=index)
                # the inbox is sized so this never blocks
                control.send_nowait(FinishRequest(rid, index))
            await send.send(out)
