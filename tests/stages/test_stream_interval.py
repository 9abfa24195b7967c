"""stages/stream_interval.py: with --stream-interval N a stream's first token is written at
once, then every N tokens, and the rest with its end; bytes and order are unchanged, and
non-streaming replies pass straight through."""
from __future__ import annotations

import types

import pytest

from stages.delta import Delta
from stages.emit import ReplyEnd
from stages.messages import Step
from stages.stream_interval import StreamInterval


def step(new=(), tokens=()):
    reqs = tuple(types.SimpleNamespace(request_id=rid, stream=stream) for rid, stream in new)
    return Step(0, reqs, tuple(Delta(rid, (1,) * n) for rid, n in tokens))


def test_first_token_at_once_then_every_n_then_the_rest_with_the_end():
    held = StreamInterval(3)
    sent = []
    # s streams, b does not; s's role chunk comes with its first step
    sent += held.route(step(new=[("s", True), ("b", False)]), [("s", b"role;")])
    sent += held.route(step(tokens=[("s", 1), ("b", 1)]), [("s", b"t1;")])
    for i in (2, 3, 4, 5):
        sent += held.route(step(tokens=[("s", 1), ("b", 1)]), [("s", b"t%d;" % i)])
    sent += held.route(step(tokens=[("s", 1), ("b", 1)]),
                       [("s", b"t6;"), ("b", b"{}"), ("b", ReplyEnd(200))])
    sent += held.route(step(tokens=[("s", 1)]), [("s", b"t7;[DONE]"), ("s", ReplyEnd(200))])
    assert sent == [
        ("s", b"role;t1;"),          # the role chunk waits for the first token, which goes at once
        ("s", b"t2;t3;t4;"),         # then three tokens at a time
        ("b", b"{}"), ("b", ReplyEnd(200)),   # not streaming: untouched
        ("s", b"t5;t6;t7;[DONE]"), ("s", ReplyEnd(200)),   # the rest with the end
    ]
    assert held.streams == {}


def test_an_interval_of_one_changes_nothing():
    held = StreamInterval(1)
    items = [("s", b"a"), ("s", ReplyEnd(200))]
    assert held.route(step(new=[("s", True)], tokens=[("s", 1)]), items) is items


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream-interval"):
        StreamInterval(0)
