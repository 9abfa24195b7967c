"""detokenize: sampled token ids -> text deltas; stop strings.

One DetokState per request: an incremental decoder (tokenizers' DecodeStream, which
holds back incomplete UTF-8; for a ByteLevel tokenizer, the same in ByteLevelStream, which
gives a running token's text without decoding when that token is a whole character or
more) and the stop-string matcher, which holds back the last
len(longest stop) - 1 characters so that a stop string split across steps is never
half-emitted. As in vLLM, a stop string only counts when it ends in the text of an
output token past the first min_tokens. With a Harmony (gpt-oss) vocabulary a stop string
only counts inside a message's content: the header words between a header token
(<|start|>, <|channel|>, <|constrain|>, or a message's end) and <|message|>, such as
"final" in <|channel|>final, are not matched (HarmonyMarks).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import trio
from tokenizers.decoders import ByteLevel, DecodeStream

from stages.delta import Delta, FinishReason, PromptLogprob, TokenLogprob
from stages.messages import FinishRequest, RenderedRequest, Step

if TYPE_CHECKING:
    from gpu.tokenizers.tokenizer import Tokenizer

_PROMPT_CONTEXT = 4  # prompt tokens fed to the decoder first, for correct leading spaces


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


_UNSEEN = object()


class CleanPieces:
    """Each token's text decoded alone, where it is a whole piece: non-empty and valid
    UTF-8 by itself (no U+FFFD), else None. Filled as tokens are first seen."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.pieces: dict[int, str | None] = {}

    def learn(self, token_id: int) -> str | None:
        piece = self.tokenizer.decode([token_id], skip_special_tokens=self.skip)
        piece = piece if piece and "\ufffd" not in piece else None
        self.pieces[token_id] = piece
        return piece


class ByteLevelStream:
    """tokenizers' DecodeStream step for step (its step_decode_stream: the ids since the
    last emitted prefix, the prefix's text, where it ends), for a tokenizer whose decoder
    is ByteLevel alone, with one shortcut. ByteLevel decodes a list of tokens as the
    concatenation of their bytes, so after a step that emitted one token's text (the state
    is [that token], its text) a next token whose own text is a whole piece (CleanPieces)
    decodes as the two pieces joined: its text is the step's output, and the state
    becomes [that token], its text, with no decode at all. Any other step decodes as
    DecodeStream does. tests/stages/test_detokenize_stream.py holds the two step for step."""

    __slots__ = ("ids", "prefix", "prefix_index", "clean", "pieces", "steady")

    def __init__(self, ids: list[int], clean: CleanPieces) -> None:
        self.ids = ids
        self.prefix = ""
        self.prefix_index = 0
        self.clean = clean
        self.pieces = clean.pieces   # clean's, read once per token
        self.steady = False   # ids == [one token], prefix_index 1, prefix its whole piece

    def step(self, tokenizer, token_id: int) -> str | None:
        if self.steady:
            piece = self.pieces.get(token_id, _UNSEEN)
            if piece is _UNSEEN:
                piece = self.clean.learn(token_id)
            if piece is not None:
                self.ids[0] = token_id
                self.prefix = piece
                return piece
        return self._step(tokenizer, token_id)

    def _step(self, tokenizer, token_id: int) -> str | None:
        ids, skip = self.ids, self.clean.skip
        self.steady = False
        if not self.prefix and ids:
            prefix = tokenizer.decode(ids, skip_special_tokens=skip)
            if not prefix.endswith("\ufffd"):
                self.prefix, self.prefix_index = prefix, len(ids)
        ids.append(token_id)
        text = tokenizer.decode(ids, skip_special_tokens=skip)
        prefix = self.prefix
        if text.endswith("\ufffd"):
            return None
        if not text.startswith(prefix):
            if len(text.encode()) > len(prefix.encode()):     # as DecodeStream fails
                raise ValueError(f"Invalid prefix encountered while decoding stream. Token ID: "
                                 f"{token_id}, Expected prefix: {prefix!r}, Actual string: {text!r}")
            return None
        if len(text) == len(prefix):
            return None
        new_prefix_index = len(ids) - self.prefix_index
        del ids[:self.prefix_index]
        self.prefix = tokenizer.decode(ids, skip_special_tokens=skip)
        self.prefix_index = new_prefix_index
        self.steady = (len(ids) == 1 and new_prefix_index == 1 and self.prefix != ""
                       and "\ufffd" not in self.prefix)
        return text[len(prefix):]


def byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is ByteLevel alone (ByteLevelStream's premise)."""
    return tokenizer is not None and type(tokenizer.decoder) is ByteLevel


@attrs.frozen
class HarmonyMarks:
    """A Harmony vocabulary's ids that open a message's content and those that open a header."""
    content: int
    header: frozenset[int]

    @classmethod
    def of(cls, tokenizer) -> HarmonyMarks | None:
        ids = [tokenizer.token_to_id(t) for t in _HARMONY_MARKS] if tokenizer is not None else [None]
        return None if None in ids else cls(ids[0], frozenset(ids[1:]))

    def in_header(self, prompt) -> bool:
        """Whether output continues a header: the prompt's last mark opens one."""
        for t in reversed(prompt):
            if t == self.content:
                return False
            if t in self.header:
                return True
        return False


_HARMONY_MARKS = ("<|message|>", "<|start|>", "<|channel|>", "<|constrain|>", "<|end|>",
                  "<|return|>", "<|call|>")


class DetokState:
    def __init__(self, req: RenderedRequest, detokenize: bool = True, index: int = 0,
                 clean: CleanPieces | None = None, harmony: HarmonyMarks | None = None) -> None:
        """`clean`: the tokenizer's CleanPieces (with req's skip_special_tokens) when it is
        ByteLevel's, for a ByteLevelStream in place of tokenizers' DecodeStream. `harmony`:
        the vocabulary's Harmony marks (stop strings skip header words)."""
        sp = req.sampling
        self.prompt = req.prompt_of(index)
        context = list(self.prompt[-_PROMPT_CONTEXT:])
        if not detokenize:
            self.stream = None
        elif clean is not None:
            self.stream = ByteLevelStream(context, clean)
        else:
            self.stream = DecodeStream(ids=context, skip_special_tokens=sp.skip_special_tokens)
        self.stops = sp.stop
        self.include_stop = sp.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.min_tokens = sp.options.min_tokens
        self.num_output = 0  # output tokens seen so far (where a stop string reads it)
        self.pending = ""   # decoded text not yet emitted: at most `hold` characters between steps
        # No stop strings: nothing is ever held back, so a running sequence's one new token
        # is just its decoded piece (Detokenizer.process's fast path, most tokens of most steps).
        self.plain = self.stream is not None and not self.stops
        self.harmony = harmony if self.stops else None
        self.in_header = harmony is not None and harmony.in_header(self.prompt)
        self.content_from = 0   # a stop string starts at or after this index of pending
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
        self.ids_as_tokens = req.reply.return_tokens_as_token_ids

    def step(self, tokenizer, d: Delta) -> Delta:
        ids = d.token_ids
        # A stop token counts as output; it is shown only when it is one of stop_token_ids
        # and include_stop_str_in_output asks for it (EOS never is), as in vLLM.
        hide_last = (d.finish_reason == FinishReason.STOP and ids
                     and not (self.include_stop and d.stop_reason is not None))
        # A stop string must end after `check_from`: in this step's text (anything through
        # older text was looked for already), and past the first min_tokens tokens' text.
        check_from = len(self.pending)
        ends = []   # len(pending) after each token: where a stop string's token is found
        for t in (ids[:-1] if hide_last else ids) if self.stream is not None else ():
            piece = self.stream.step(tokenizer, t)
            if piece:
                self.pending += piece
            self.num_output += 1
            if self.num_output <= self.min_tokens:
                check_from = len(self.pending)
            if self.harmony is not None:
                if t == self.harmony.content:
                    self.in_header = False
                    self.content_from = len(self.pending)
                elif t in self.harmony.header:
                    self.in_header = True
                if self.in_header:
                    self.content_from = len(self.pending)
            ends.append(len(self.pending))
        finish, stop_reason = d.finish_reason, d.stop_reason
        token_logprobs = d.token_logprobs
        if self.stops and finish != FinishReason.ABORT:
            hit = self._find_stop(check_from)
            if hit is not None:
                pos, s = hit
                self.pending = self.pending[:pos + len(s) if self.include_stop else pos]
                finish, stop_reason = FinishReason.STOP, s
                # several tokens in one delta (speculative decoding, --stream-interval): the
                # tokens after the one that completes the stop string were never output
                last = next((i for i, e in enumerate(ends) if e >= pos + len(s)), len(ids) - 1)
                if last < len(ids) - 1:
                    ids, token_logprobs = ids[:last + 1], token_logprobs[:last + 1]
        cut = len(self.pending) if finish is not None else max(0, len(self.pending) - self.hold)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        self.content_from = max(0, self.content_from - cut)
        named_by = None if self.ids_as_tokens else tokenizer    # token_text's "token_id:N"
        logprobs = tuple(
            TokenLogprob(token_text(named_by, t), lp.logprob,
                         tuple((token_text(named_by, i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))
            for t, lp in zip(ids, token_logprobs))
        if finish is None and not token_logprobs and not d.prompt_token_logprobs:
            return d.running_text(text)    # its premise (a stop string's request, running)
        prompt_logprobs = (self.prompt_logprobs(tokenizer, d.prompt_token_logprobs)
                           if d.prompt_token_logprobs else d.prompt_logprobs)
        return d.detokenized(text, logprobs, finish, stop_reason, ids, token_logprobs,
                             prompt_logprobs)

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
            i = self.pending.find(s, max(self.content_from, check_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


class Detokenizer:
    """The pure core: per-request states, one Step in, the same Step with text out.
    With no tokenizer (a model served from token ids only) deltas carry tokens, no text."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.hf = None if tokenizer is None else tokenizer.hf
        # request id -> its choices' states, None once a choice finished (by request, not
        # (request, choice): one str hash per token, no tuple built and hashed)
        self.states: dict[str, list[DetokState | None]] = {}
        # a ByteLevel tokenizer's whole pieces, by skip_special_tokens (ByteLevelStream)
        self.clean = ({skip: CleanPieces(self.hf, skip) for skip in (False, True)}
                      if byte_level(self.hf) else None)
        self.harmony = HarmonyMarks.of(self.hf)

    def process(self, msg: Step) -> tuple[Step, list[tuple[str, int]]]:
        """Returns the step's deltas and the (request, choice) a stop string finished."""
        for req in msg.new_requests:
            self.states[req.request_id] = choices = [None] * req.num_choices
            for i in range(req.num_choices):
                choices[i] = DetokState(
                    req, self.hf is not None, i,
                    None if self.clean is None else self.clean[req.sampling.skip_special_tokens],
                    self.harmony)
        deltas, stopped = [], []
        append = deltas.append
        hf, states = self.hf, self.states
        for d in msg.deltas:
            choices = states.get(d.request_id)
            st = None if choices is None else choices[d.index]
            if st is None:
                continue  # already finished here (a stop string), the scheduler catching up
            ids = d.token_ids
            if (st.plain and d.finish_reason is None and len(ids) == 1 and not d.token_logprobs
                    and not d.prompt_token_logprobs):     # Delta.running_text's premise
                # (no stop strings, so num_output, which only min_tokens' hold on a stop
                # string reads, is not kept)
                append(d.running_text(st.stream.step(hf, ids[0]) or ""))
                continue
            out = st.step(hf, d)
            if out.finished:
                choices[d.index] = None
                if all(c is None for c in choices):
                    del states[d.request_id]
                if not d.finished:
                    stopped.append((d.request_id, d.index))
            append(out)
        return msg.with_deltas(tuple(deltas)), stopped


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
