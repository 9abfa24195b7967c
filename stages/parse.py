"""parse: text deltas -> content, reasoning and tool calls.

A request with a tool plan (stages/api/tools.py) gets a tool parser
(stages/api/tool_parsers/), fed the content after any reasoning: calls come out whole in
`Delta.tool_calls`, and a turn that made a call and stopped ends with finish_reason
tool_calls.

With a <think> reasoning parser (THINK_PARSERS) the text between <think> and </think> is
reasoning. A partial tag at the end of a delta is held back until the next step shows
whether it is a tag. qwen3 (glm45, kimi_k2, deepseek_v3: the same tags, vLLM's names)
starts in content and enters reasoning on a leading <think>; deepseek_r1's and
minimax_m2's templates open <think> in the prompt, so they start in reasoning; either way
the prompt's last tag, when it has one, decides (deepseek_v3's thinking on or off per
request is its template's <think> or </think>). minimax_m2_append_think splits nothing:
the reasoning stays in the content, with the <think> the template opened put back in
front, as MiniMax's own clients read it. mistral (Magistral's tekken [THINK] ... [/THINK])
and granite (Granite 3.2's "Here is my thought process:" ... "Here is my response:", or
"Here's", as vLLM matches both) split as qwen3 does with their own markers (THINK_TAGS);
their prompts do not decide (Magistral's system prompt shows the tags as an example, and
Granite's phrases are no tokens), so they always start in content.

openai_gptoss (gpt-oss, implied for that model) parses Harmony from the token ids, not the
text (stages/api/harmony.py): channels give reasoning, content and tool calls at once. A
named or required tool_choice is constrained JSON there as for every model, read by the
same text parsers.
"""
from __future__ import annotations

import attrs
import trio

from stages.delta import Delta, FinishReason, ToolCallDelta
from stages.api.harmony import HARMONY_REASONING_PARSER, HarmonyState
from stages.messages import Step, ToolPlan
from stages.api.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser,
                                 ToolParser, CALL_IDS, call_id)
from stages.api.tool_parsers.base import partial_suffix

# --reasoning-parser NAME -> where its output starts: "start" (content, unless it opens
# <think>), "reasoning" (the template opened <think>), "append" (no split)
THINK_PARSERS = {"qwen3": "start", "glm45": "start", "kimi_k2": "start",
                 "deepseek_v3": "start", "deepseek_r1": "reasoning", "minimax_m2": "reasoning",
                 "minimax_m2_append_think": "append"}
THINK_PARSERS |= {"mistral": "start", "granite": "start"}
REASONING_PARSERS = (*THINK_PARSERS, HARMONY_REASONING_PARSER)
_OPEN, _CLOSE = "<think>", "</think>"


@attrs.frozen
class Markers:
    """How a parser's reasoning opens and closes: each a tuple of spellings (the first
    the canonical one), and whether the prompt's last marker decides where it starts."""
    opens: tuple[str, ...] = (_OPEN,)
    closes: tuple[str, ...] = (_CLOSE,)
    prompt_decides: bool = True


THINK_TAGS = {
    "mistral": Markers(("[THINK]",), ("[/THINK]",), False),
    "granite": Markers(("Here is my thought process:", "Here's my thought process:"),
                       ("Here is my response:", "Here's my response:"), False),
}


def markers(parser: str) -> Markers:
    return THINK_TAGS.get(parser, Markers())


def _first(buf: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `tags` in buf: (index, tag), or (-1, "")."""
    hits = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
    return min(hits) if hits else (-1, "")


def _unparsed(d: Delta) -> bool:
    """Whether d already is what parse makes of it without a parser: its text as content
    (detokenize starts content there), no reasoning."""
    return (d.content == d.text and not d.reasoning and not d.reasoning_tokens
            and not d.reasoning_span)


@attrs.frozen
class ThinkTags:
    """How a tokenizer spells <think> and </think>: each one's token id where it is one
    token (Qwen3's, DeepSeek-R1's), else None, and the tokenizer, to read a prompt's text
    where they are not (a model without them as tokens, as the tests' tiny ones)."""
    open_id: int | None = None
    close_id: int | None = None
    tokenizer: object = None

    @classmethod
    def of(cls, tokenizer, marks: Markers = Markers()) -> ThinkTags:
        if tokenizer is None:
            return cls()
        ids = [tokenizer.encode(tag, add_special_tokens=False)
               for tag in (marks.opens[0], marks.closes[0])]
        return cls(*(t[0] if len(t) == 1 else None for t in ids),
                   tokenizer if marks.prompt_decides else None)

    def prompt_state(self, prompt: tuple[int, ...]) -> str | None:
        """Where a prompt leaves the reasoning: its last tag decides (as vLLM's
        is_reasoning_end): "reasoning" after <think>, "content" after </think>, None when
        it has neither (or nothing can read it)."""
        if self.open_id is not None and self.close_id is not None:
            for tok in reversed(prompt):
                if tok == self.open_id:
                    return "reasoning"
                if tok == self.close_id:
                    return "content"
            return None
        if self.tokenizer is None or not prompt:   # (or the parser's prompt does not decide)
            return None
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        opened, closed = text.rfind(_OPEN), text.rfind(_CLOSE)
        if opened == closed:     # both -1: no tag
            return None
        return "reasoning" if opened > closed else "content"


class ThinkState:
    """Splits one choice's text stream at <think> ... </think>."""

    def __init__(self, parser: str, start: str | None = None,
                 tags: ThinkTags = ThinkTags()) -> None:
        # `start`: where the prompt left the reasoning (ThinkTags.prompt_state)
        kind = THINK_PARSERS[parser]
        self.marks = markers(parser)
        if not self.marks.prompt_decides:
            start = None
        self.mode = "append" if kind == "append" else start or kind
        self.tags = tags
        self.buf = ""
        self.opened_once = False            # append: the <think> was put back
        self.opened = self.closed = False   # this feed entered / left the reasoning
        self.reasoning_tokens = 0   # the choice's output tokens inside the reasoning so far

    def feed(self, text: str, final: bool, token_ids: tuple[int, ...] = ()
             ) -> tuple[str, str, int, int]:
        """Split the next text (of `token_ids`): (content, reasoning, the reasoning's
        tokens among them, how many of them from the start are the reasoning's, tags
        included). Tokens are counted by where the choice's whole output stands, not by
        what one delta shows: a token whose text is held back (a partial tag, an
        unfinished character) is reasoning when it falls inside it; the tokens that open
        or close the reasoning are not (as vLLM). A delta of several tokens that crosses a
        tag is split at the tag's token where the tag is one token; else each tag is
        taken to be one token of it."""
        before = self.mode
        self.opened = self.closed = False
        content, reasoning = self._split(text, final)
        n = len(token_ids)
        if before != "reasoning" and not self.opened:
            return content, reasoning, 0, 0
        tokens, span = n, n
        if self.opened or self.closed:
            tokens, span = self._cut(list(token_ids))
        self.reasoning_tokens += tokens
        return content, reasoning, tokens, span

    def _cut(self, ids: list[int]) -> tuple[int, int]:
        """(reasoning tokens, span) of a delta that opened or closed the reasoning."""
        n, tags = len(ids), self.tags
        lo, hi = 0, n
        if self.opened:
            lo = ids.index(tags.open_id) + 1 if tags.open_id in ids else -1
        if self.closed and lo >= 0:
            hi = ids.index(tags.close_id, lo) if tags.close_id in ids[lo:] else -1
        if lo < 0 or hi < 0:   # the tag is not one token here
            return max(0, n - self.opened - self.closed), n
        return hi - lo, hi + 1 if self.closed else n

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        self.buf += text
        content = reasoning = ""
        if self.mode == "append":      # the <think> the prompt opened, then everything
            content, self.buf = ("" if self.opened_once else _OPEN) + self.buf, ""
            self.opened_once = True
            return content, ""
        opens, closes = self.marks.opens, self.marks.closes
        while True:
            if self.mode == "start":
                stripped = self.buf.lstrip()
                tag = next((t for t in opens if stripped.startswith(t)), None)
                if tag is not None:
                    self.buf = stripped[len(tag):]
                    self.mode = "reasoning"
                    self.opened = True
                elif any(t.startswith(stripped) for t in opens) and not final:
                    return content, reasoning  # could still become the opening
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                i, tag = _first(self.buf, closes)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(tag):]
                    self.mode = "content"
                    self.closed = True
                    continue
                keep = 0 if final else max(partial_suffix(self.buf, t) for t in closes)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return content, reasoning
            else:
                content += self.buf
                self.buf = ""
                return content, reasoning


class ToolState:
    """One request's tool-call parsing: its parser, and how many calls it has made."""

    def __init__(self, request_id: str, plan: ToolPlan, make_id=call_id) -> None:
        """`make_id(request_id, n)`: call n's id (the tokenizer's form, CALL_IDS)."""
        self.request_id = request_id
        self.make_id = make_id
        self.parser = _tool_parser(plan)
        self.parallel = plan.parallel
        self.num_calls = 0
        # as vLLM (and OpenAI): a call made for "auto" or "required" finishes the turn with
        # tool_calls, one of a named tool_choice with stop
        self.finishes_with_calls = plan.kind != "named"

    def feed(self, text: str, final: bool) -> tuple[str, tuple[ToolCallDelta, ...]]:
        content, calls = self.parser.feed(text, final)
        return content, self.numbered(calls)

    def numbered(self, calls) -> tuple[ToolCallDelta, ...]:
        out = []
        for call in calls:
            if self.num_calls and not self.parallel:
                break                  # parallel_tool_calls false: the first call only
            out.append(ToolCallDelta(self.num_calls, self.make_id(self.request_id, self.num_calls),
                                     call.name, call.arguments))
            self.num_calls += 1
        return tuple(out)


class HarmonyChoice:
    """One choice of a Harmony request: the token parser, and its calls' numbering."""

    def __init__(self, request_id: str, plan: ToolPlan | None) -> None:
        self.harmony = HarmonyState(plan)
        self.tools = ToolState(request_id, plan) if plan is not None else None

    def feed(self, d: Delta) -> Delta:
        out = self.harmony.feed(d.token_ids, d.finished)
        calls = self.tools.numbered(out.calls) if self.tools is not None else ()
        reason = d.finish_reason
        if reason is FinishReason.STOP and self.tools is not None and self.tools.num_calls:
            reason = FinishReason.TOOL_CALLS
        # the analysis tokens, each counted by HarmonyState (account sums the deltas)
        return d.parsed(out.content, out.reasoning, calls, reason, out.reasoning_tokens,
                        out.reasoning_span)


def _tool_parser(plan: ToolPlan) -> ToolParser:
    if plan.kind == "named":
        return NamedToolParser(plan.name)
    if plan.kind == "required":
        return RequiredToolParser()
    return TOOL_PARSERS[plan.parser]()


class Parser:
    def __init__(self, reasoning_parser: str | None = None, tokenizer=None) -> None:
        """`tokenizer`: the served one, for how it spells the <think> tags (ThinkTags);
        without it every choice starts where its parser does."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; "
                             f"choose from {', '.join(REASONING_PARSERS)}")
        self.reasoning_parser = reasoning_parser
        self.call_id = CALL_IDS[tokenizer.tool_call_ids if tokenizer is not None else "openai"]
        self.think_tags = (ThinkTags.of(tokenizer, markers(reasoning_parser))
                           if reasoning_parser in THINK_PARSERS else ThinkTags())
        self.states: dict[tuple[str, int], ThinkState] = {}   # (request id, choice)
        self.tools: dict[tuple[str, int], ToolState] = {}
        self.harmony: dict[tuple[str, int], HarmonyChoice] = {}

    def process(self, msg: Step) -> Step:
        for req in msg.new_requests:
            starts: dict[int, str | None] = {}   # per prompt: where it left the reasoning
            for i in range(req.num_choices):      # each choice has its own state
                if self.reasoning_parser == HARMONY_REASONING_PARSER and (
                        req.tools is None or req.tools.kind == "auto"):
                    self.harmony[req.request_id, i] = HarmonyChoice(
                        f"{req.request_id}#{i}", req.tools)
                    continue
                if self.reasoning_parser not in (None, HARMONY_REASONING_PARSER):
                    p = i // req.n
                    if p not in starts:
                        starts[p] = self.think_tags.prompt_state(req.prompt_of(i))
                    self.states[req.request_id, i] = ThinkState(
                        self.reasoning_parser, starts[p], self.think_tags)
                if req.tools is not None:
                    self.tools[req.request_id, i] = ToolState(f"{req.request_id}#{i}", req.tools,
                                                              self.call_id)
        if not self.states and not self.tools and not self.harmony:
            for d in msg.deltas:   # _unparsed(d), inline: this loop sees every token
                if d.content != d.text or d.reasoning or d.reasoning_tokens or d.reasoning_span:
                    return msg.with_deltas(tuple(d.parsed(d.text, "", d.tool_calls,
                                                          d.finish_reason, 0, 0)
                                                 for d in msg.deltas))
            return msg    # every delta already is its own parse (see _unparsed)
        out = []
        for d in msg.deltas:
            key = (d.request_id, d.index)
            harmony = self.harmony.get(key)
            if harmony is not None:
                out.append(harmony.feed(d))
                if d.finished:
                    del self.harmony[key]
                continue
            st = self.states.get(key)
            content, reasoning, counted, span = (st.feed(d.text, d.finished, d.token_ids)
                                                 if st else (d.text, "", 0, 0))
            tools = self.tools.get(key)
            if d.finished:
                self.states.pop(key, None)
                self.tools.pop(key, None)
            if tools is None:
                out.append(d if st is None and _unparsed(d)
                           else d.parsed(content, reasoning, d.tool_calls, d.finish_reason,
                                         counted, span))
                continue
            content, calls = tools.feed(content, d.finished)
            reason = d.finish_reason
            if reason is FinishReason.STOP and tools.num_calls and tools.finishes_with_calls:
                reason = FinishReason.TOOL_CALLS
            out.append(d.parsed(content, reasoning, calls, reason, counted, span))
        return msg.with_deltas(tuple(out))


async def run(receive: trio.MemoryReceiveChannel, send: trio.MemorySendChannel, core: Parser,
              log=None) -> None:
    async with receive, send:
        async for msg in receive:
            out = core.process(msg)
            if log is not None:
                log("parsed", step=out.step, deltas=out.deltas)
            await send.send(out)
