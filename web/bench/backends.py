"""Request builders and per-event stream interpretation for each backend.

A backend turns a prompt into a JSON payload, and turns one parsed SSE event
into an ``Observation``: did it carry a token, which output text, which usage,
was it terminal, did it report an error. ``StreamAccount`` (in ``account.py``)
does the timing and is the same for every backend.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import orjson

from web.bench.sse import SSEEvent


class BenchConfigError(ValueError):
    """A flag combination the benchmark refuses before sending anything."""


@attrs.frozen
class Usage:
    prompt_tokens: int | None
    output_tokens: int | None


@attrs.frozen
class Observation:
    """What one SSE event means for accounting."""

    is_token: bool = False  # token-bearing: starts TTFT, adds an ITL sample, moves E2EL's end
    text: str = ""  # output text only; reasoning is timed but not kept
    usage: Usage | None = None
    terminal: bool = False
    error: str | None = None


@attrs.frozen
class SamplingParams:
    """Sampling fields passed through only when given on the command line."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen
class Backend:
    name: str
    default_endpoint: str
    endpoint_suffix: str  # an --endpoint must end with this (and not with another backend's)
    build_payload: Callable[..., dict[str, Any]]
    interpret: Callable[[SSEEvent], Observation]
    unsupported_sampling: frozenset[str] = frozenset()
    stream: bool = True   # False: one JSON body, read whole and interpreted as one event

    def check_endpoint(self, endpoint: str) -> None:
        path = endpoint.rstrip("/")
        fits = path.endswith(self.endpoint_suffix)
        if self.name == "openai-completions" and path.endswith("/chat/completions"):
            fits = False
        if not fits:
            raise BenchConfigError(
                f"--endpoint {endpoint} does not fit backend {self.name}; "
                f"it expects {self.default_endpoint}"
            )

    def check_sampling(self, sampling: SamplingParams) -> None:
        refused = sorted(self.unsupported_sampling & sampling.given().keys())
        if refused:
            flags = ", ".join("--" + name.replace("_", "-") for name in refused)
            raise BenchConfigError(f"{flags} is not supported by backend {self.name}: its API has no such field")


def _payload_common(payload: dict[str, Any], sampling: SamplingParams, ignore_eos: bool,
                    extra_body: dict[str, Any] | None) -> dict[str, Any]:
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(sampling.given())
    if extra_body:
        payload.update(extra_body)
    return payload


def chat_payload(*, model: str, prompt: str, max_tokens: int, sampling: SamplingParams,
                 ignore_eos: bool = False, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_completion_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _payload_common(payload, sampling, ignore_eos, extra_body)


def completions_payload(*, model: str, prompt: str, max_tokens: int, sampling: SamplingParams,
                        ignore_eos: bool = False, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _payload_common(payload, sampling, ignore_eos, extra_body)


def responses_payload(*, model: str, prompt: str, max_tokens: int, sampling: SamplingParams,
                      ignore_eos: bool = False, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = {
        "model": model,
        "input": prompt,
        "max_output_tokens": max_tokens,
        "stream": True,
        "store": False,
    }
    return _payload_common(payload, sampling, ignore_eos, extra_body)


def _load(event: SSEEvent) -> dict[str, Any] | Observation:
    try:
        body = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return Observation(error=f"unparseable event data: {event.data[:200]!r}")
    if not isinstance(body, dict):
        return Observation(error=f"event data is not a JSON object: {event.data[:200]!r}")
    return body


def error_message(error: Any) -> str:
    """The server's message from an OpenAI-shaped error object (or anything else)."""
    if isinstance(error, dict):
        message = error.get("message")
        if message:
            return str(message)
        return orjson.dumps(error).decode()
    return str(error)


def _chat_like_usage(body: dict[str, Any]) -> Usage | None:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    return Usage(prompt_tokens=usage.get("prompt_tokens"), output_tokens=usage.get("completion_tokens"))


def _first_choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices") or []
    return choices[0] if choices and isinstance(choices[0], dict) else {}


def interpret_chat(event: SSEEvent) -> Observation:
    body = _load(event)
    if isinstance(body, Observation):
        return body
    if body.get("error") is not None:
        return Observation(error=error_message(body["error"]))
    delta = _first_choice(body).get("delta") or {}
    content = delta.get("content") or ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return Observation(is_token=bool(content or reasoning), text=content, usage=_chat_like_usage(body))


def interpret_completions(event: SSEEvent) -> Observation:
    body = _load(event)
    if isinstance(body, Observation):
        return body
    if body.get("error") is not None:
        return Observation(error=error_message(body["error"]))
    text = _first_choice(body).get("text") or ""
    return Observation(is_token=bool(text), text=text, usage=_chat_like_usage(body))


def _responses_usage(response: dict[str, Any]) -> Usage | None:
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    return Usage(prompt_tokens=usage.get("input_tokens"), output_tokens=usage.get("output_tokens"))


def interpret_responses(event: SSEEvent) -> Observation:
    body = _load(event)
    if isinstance(body, Observation):
        return body
    kind = body.get("type") or event.event
    if kind == "response.output_text.delta":
        text = body.get("delta") or ""
        return Observation(is_token=bool(text), text=text)
    if kind == "response.reasoning_text.delta":
        return Observation(is_token=bool(body.get("delta")))
    if kind in ("response.completed", "response.incomplete"):
        # An incomplete response (e.g. max_output_tokens reached) is a successful request.
        return Observation(terminal=True, usage=_responses_usage(body.get("response") or {}))
    if kind == "response.failed":
        response = body.get("response") or {}
        message = error_message(response.get("error") or "response.failed")
        return Observation(terminal=True, error=message, usage=_responses_usage(response))
    if kind == "error":
        return Observation(error=error_message(body.get("error") or body))
    return Observation()


def embeddings_payload(*, model: str, prompt: str | list[str], max_tokens: int, sampling: SamplingParams,
                       ignore_eos: bool = False, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's openai-embeddings backend: the prompt (or several, --inputs-per-request) as input."""
    payload: dict[str, Any] = {"model": model, "input": prompt}
    if extra_body:
        payload.update(extra_body)
    return payload


def interpret_embeddings(event: SSEEvent) -> Observation:
    """The whole reply body: one token-bearing, terminal event (its arrival is the latency)."""
    body = _load(event)
    if isinstance(body, Observation):
        return body
    if body.get("error") is not None:
        return Observation(error=error_message(body["error"]))
    if not isinstance(body.get("data"), list) or not body["data"]:
        return Observation(error=f"no embeddings in the reply: {event.data[:200]!r}")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return Observation(is_token=True, terminal=True,
                       usage=Usage(prompt_tokens=usage.get("prompt_tokens"), output_tokens=0))


CHAT = Backend("openai-chat", "/v1/chat/completions", "/chat/completions", chat_payload, interpret_chat)
COMPLETIONS = Backend("openai-completions", "/v1/completions", "/completions", completions_payload,
                      interpret_completions)
RESPONSES = Backend("openai-responses", "/v1/responses", "/responses", responses_payload, interpret_responses,
                    unsupported_sampling=frozenset({"min_p"}))

EMBEDDINGS = Backend("openai-embeddings", "/v1/embeddings", "/embeddings", embeddings_payload,
                     interpret_embeddings, unsupported_sampling=frozenset(attrs.fields_dict(SamplingParams)),
                     stream=False)

# vLLM's `bench serve` also calls the completions backend "openai" and "vllm", so a copied
# `vllm bench serve --backend vllm ...` command runs unchanged.
BACKEND_ALIASES = {"openai": COMPLETIONS, "vllm": COMPLETIONS}
BACKENDS: dict[str, Backend] = {**{b.name: b for b in (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)},
                                **BACKEND_ALIASES}
