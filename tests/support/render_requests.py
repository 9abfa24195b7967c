"""Requests rendered as the render stage renders them, over a fake tokenizer (one token per
character, a visible chat template), for the stage tests of rendering (tests/stages/
test_render.py and the tool, structured-output and priority tests beside it)."""
import pytest

from stages.messages import Submission
from stages.render import RenderContext, RequestError, render

class FakeTokenizer:
    """One token per character; a visible template so tests can read the prompt."""

    vocab_size = 1000
    bos_token_id = None
    eos_token_ids = (999,)

    def __init__(self):
        self.template_calls = []

    def encode(self, text, add_special_tokens=False):
        ids = [ord(c) % 900 for c in text]
        return ([998] + ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **kwargs):
        self.template_calls.append((messages, add_generation_prompt, kwargs))
        if kwargs.get("explode"):
            raise ValueError("template exploded")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def make_ctx(max_model_len=100, **kwargs):
    return RenderContext(tokenizer=FakeTokenizer(), served_model_names=("tiny", "alias"),
                         max_model_len=max_model_len, **kwargs)


def chat(body, ctx=None, request_id="r1"):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return render(Submission(request_id, "chat", body, 1.5), ctx or make_ctx())


def completion(body, ctx=None):
    return render(Submission("r1", "completions", {"prompt": "hello", **body}, 1.5),
                  ctx or make_ctx())


def responses(body, ctx=None):
    return render(Submission("r1", "responses", {"input": "hi", **body}, 1.5),
                  ctx or make_ctx())


def error_of(fn, *args):
    with pytest.raises(RequestError) as info:
        fn(*args)
    return info.value
