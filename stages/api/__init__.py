"""One module per API (chat.py, completions.py, responses.py, and Anthropic's Messages API
in anthropic.py): its request and reply
types, its request -> PromptPlan mapping (with the ReplySpec of what the reply shows and
echoes) and its reply framer; the Responses API's reply and framer have a module of their
own (responses_framing.py). common.py holds the machinery they share (errors, the strict
converter, parse_request, PromptPlan, usage rules), request_types.py the request pieces and
fields they share, framing.py what every framer shares (usage objects included),
tokenize.py the /tokenize and /detokenize types.

`APIS` is the one registry: web routes each path to its API's name, render structures and
plans a submission through it, emit frames each reply with its framer.
"""
from __future__ import annotations

from typing import Callable

import attrs

from stages.api import anthropic, chat, completions, responses, responses_framing
from stages.api.common import PromptPlan, RequestError
from stages.api.framing import Framer
from stages.api.request_types import SamplingRequest
from stages.messages import ReplySpec


@attrs.frozen
class ApiSpec:
    """An API: its HTTP path, typed request, mapping to a PromptPlan and reply framer."""
    name: str
    path: str
    request: type[SamplingRequest]
    plan: Callable[..., PromptPlan]
    framer: type[Framer]
    reply_spec: Callable[..., ReplySpec]   # what plan puts in PromptPlan.reply (the event
                                           # log's older files logged the typed request)
    # the body of an error before the reply starts (OpenAI's shape unless the API has its own)
    error_body: Callable[[RequestError], dict] = RequestError.to_dict


APIS: dict[str, ApiSpec] = {spec.name: spec for spec in (
    ApiSpec("chat", "/v1/chat/completions", chat.ChatCompletionRequest, chat.plan,
            chat.ChatFramer, chat.reply_spec),
    ApiSpec("completions", "/v1/completions", completions.CompletionRequest, completions.plan,
            completions.CompletionFramer, completions.reply_spec),
    ApiSpec("responses", "/v1/responses", responses.ResponsesRequest, responses.plan,
            responses_framing.ResponsesFramer, responses.reply_spec),
    ApiSpec("messages", "/v1/messages", anthropic.MessagesRequest, anthropic.plan,
            anthropic.MessagesFramer, anthropic.reply_spec, anthropic.error_dict),
)}
