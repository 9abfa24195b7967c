"""Harmony (gpt-oss) turns for the stage tests (tests/stages/test_harmony.py,
test_multi_token_deltas.py): assistant messages built with openai-harmony's own API, the
tokens the model writes for them, and those tokens parsed as the parse stage sees them
(cut into any pieces) with what the deltas joined up say."""
from __future__ import annotations

import attrs
from openai_harmony import Message, Role

from stages.api.common import ToolPlan
from stages.delta import Delta, FinishReason, Usage
from stages.messages import Step
from stages.parse import Parser
from tests.support.rendered import rendered

def said(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def call(name: str, args: str) -> Message:
    return (Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
            .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))


def completion(enc, *messages: Message, end: str = "<|return|>") -> list[int]:
    """What the model writes after the prompt's `<|start|>assistant`: the messages as
    openai-harmony renders them, without that first header, the last one ending in `end`
    (<|return|> for an answer; a call already ends in <|call|>)."""
    head = enc.encode("<|start|>assistant", allowed_special="all")
    ids = [t for m in messages for t in enc.render(m)]
    assert ids[:len(head)] == head
    ids = ids[len(head):]
    last = enc.encode(end, allowed_special="all")[0]
    if ids[-1] == enc.encode("<|end|>", allowed_special="all")[0]:
        ids[-1] = last
    return ids


def parse(pieces: list[list[int]], *, api="chat", plan: ToolPlan | None = None,
          finish=FinishReason.STOP, stream=False, body=None, text=None):
    req = rendered("r1", api=api, stream=stream, body=body)
    req = attrs.evolve(req, tools=plan)
    parser = Parser("openai_gptoss")
    deltas = []
    for i, ids in enumerate(pieces):
        last = i == len(pieces) - 1
        d = Delta("r1", tuple(ids), finish if last else None,
                  text="" if text is None else text[i], usage=Usage(3, i + 1) if last else None)
        deltas.append(parser.process(Step(i, (req,) if i == 0 else (), (d,))).deltas[0])
    assert not parser.harmony
    return req, deltas


def joined(deltas):
    return ("".join(d.content for d in deltas), "".join(d.reasoning for d in deltas),
            [(c.index, c.name, c.arguments) for d in deltas for c in d.tool_calls],
            deltas[-1].finish_reason)


AUTO = ToolPlan("auto", parser="openai")
