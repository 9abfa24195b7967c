"""POST /tokenize and POST /detokenize (vLLM's): their requests and replies; render
tokenizes and detokenizes (stages/render.py `tokenize`, `detokenize`)."""
from __future__ import annotations

from typing import Any, ClassVar

import attrs

from stages.api.common import Invalid, opt
from stages.api.request_types import ChatMessage

@attrs.frozen
class TokenizeRequest:
    """POST /tokenize, as vLLM serves it: a completion-style `prompt`, or chat `messages`."""
    model: str | None = opt()
    prompt: str | None = opt()
    messages: list[ChatMessage] | None = opt()
    add_special_tokens: bool | None = opt()    # default: true for a prompt, false for messages
    add_generation_prompt: bool = opt(default=True)
    continue_final_message: bool = opt(default=False)
    chat_template: str | None = opt()
    chat_template_kwargs: dict[str, Any] | None = opt()
    tools: list[dict[str, Any]] | None = opt()
    return_token_strs: bool = opt(default=False)
    mm_processor_kwargs: dict[str, Any] | None = opt()    # the image processor's options
    _not_implemented: ClassVar[dict[str, Any]] = {"media_io_kwargs": ()}


@attrs.frozen
class DetokenizeRequest:
    model: str | None = opt()
    tokens: list[int] = opt()
    _not_implemented: ClassVar[dict[str, Any]] = {}

    @tokens.validator
    def _tokens(self, attribute, value) -> None:
        if value is None:
            raise Invalid("is required.", attribute.name)
        if any(t < 0 for t in value):
            raise Invalid("must be non-negative integers.", attribute.name)


@attrs.frozen(kw_only=True)
class TokenizeResponse:
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


@attrs.frozen(kw_only=True)
class DetokenizeResponse:
    prompt: str


