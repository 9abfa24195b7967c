"""One way for stage tests to make a RenderedRequest: the typed request is parsed from a
JSON body as render would and its API makes the ReplySpec of it, the prompt ids and
sampling options are given directly."""
from __future__ import annotations

from gpu.interface import SamplingOptions
from stages.api.common import parse_request
from stages.messages import RenderedRequest, SamplingParams
from stages.render import APIS

PROMPTS = {"chat": {"messages": [{"role": "user", "content": "hi"}]},
           "completions": {"prompt": "hi"}, "responses": {"input": "hi"}}
_OWN = ("stop", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def rendered(rid: str = "r1", prompt=(1, 2, 3), api: str = "completions", *, stream: bool = False,
             include_usage: bool = True, max_tokens: int = 8, body: dict | None = None,
             model: str = "m", created: int = 0, **sampling) -> RenderedRequest:
    """`sampling` holds SamplingOptions fields (temperature defaults to greedy) and the
    SamplingParams ones (stop, ignore_eos, ...); `body` extra JSON fields of the request."""
    typed = parse_request({**PROMPTS[api], "stream": stream, **(body or {})}, APIS[api].request)
    own = {k: sampling.pop(k) for k in _OWN if k in sampling}
    sp = SamplingParams(max_tokens=max_tokens,
                        options=SamplingOptions(**{"temperature": 0.0, **sampling}), **own)
    return RenderedRequest(rid, api, model, tuple(prompt), sp, stream, include_usage, created,
                           0.0, APIS[api].reply_spec(typed), n=getattr(typed, "n", 1))
