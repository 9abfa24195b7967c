"""The pooling APIs (vLLM's shapes, issue 32): POST /v1/embeddings, /pooling, /score,
/rerank (and /v1/rerank, /v2/rerank: Jina's and Cohere's shape), /classify.

Each request becomes a `PoolingPlan`: the inputs to run (a text, token ids, or a text
pair for a cross-encoder), one sequence each, what each asks of the runner
(`PoolingOptions`) and what the reply needs (`PoolingReply`). Render tokenizes the inputs
(stages/render.py); the runner pools each into a float32 vector (gpu/worker/pooling_runner.py);
the framer here turns the request's vectors into its one JSON body.

Scores: a bi-encoder (an embedding model) scores a pair by the cosine of its two
embeddings, a cross-encoder (a classifier with one label) by its head's output on the
pair, through its activation (sigmoid). /rerank is /score of the query against each
document, sorted by score.
"""
from __future__ import annotations

import base64
import uuid
from typing import Any, ClassVar

import attrs
import numpy as np
import orjson

from gpu.interface import PoolingOptions
from gpu.config.pooling import PoolingConfigError, PoolingSpec, check_dimensions
from stages.api.common import Invalid, RequestError, one_of, opt, server_error
from stages.api.framing import Framer, json_body
from stages.api.request_types import ChatMessage
from stages.delta import Delta, FinishReason
from stages.messages import PoolingReply

ENCODING_FORMATS = ("float", "base64")
MAX_INPUTS = 2048        # inputs (sequences) per request: vLLM has no limit; a bound on memory

# -- requests ----------------------------------------------------------------------------


@attrs.frozen
class PoolingBase:
    """What every pooling request shares."""
    model: str | None = opt()
    user: str | None = opt()                                     # ignored
    truncate_prompt_tokens: int | None = opt()   # keep this many tokens (-1: max_model_len)
    priority: int = opt(default=0)                               # ignored: one priority class
    request_id: str | None = opt()                               # ignored: x-request-id names it
    _not_implemented: ClassVar[dict[str, Any]] = {"mm_processor_kwargs": (), "cache_salt": ()}

    @truncate_prompt_tokens.validator
    def _truncate(self, attribute, value) -> None:
        if value is not None and value < -1:
            raise Invalid("must be -1 (the model's length) or at least 0.", attribute.name)


@attrs.frozen
class EmbeddingRequest(PoolingBase):
    """POST /v1/embeddings (OpenAI's; vLLM's extensions) and POST /pooling: `input`, or
    vLLM's chat-style `messages` rendered through the chat template."""
    input: Any = opt()                 # a string, strings, token ids or lists of them
    messages: list[ChatMessage] | None = opt()
    encoding_format: str = opt(one_of(*ENCODING_FORMATS), default="float")
    dimensions: int | None = opt()
    normalize: bool | None = opt()     # vLLM's: L2-normalize (the model's default when absent)
    add_special_tokens: bool | None = opt()   # default: true for input, false for messages
    chat_template: str | None = opt()
    chat_template_kwargs: dict[str, Any] | None = opt()
    add_generation_prompt: bool = opt(default=False)
    continue_final_message: bool = opt(default=False)
    # vLLM's /pooling names the model's task ("embed", "classify", ...): the server's runner
    # has one, so it is accepted and the runner's is served
    task: str | None = opt()
    use_activation: bool | None = opt()   # vLLM's: an embedding has no activation to apply


# vLLM's names for /score's two sides, in the order it tries them
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
               ("data_1", "data_2"))


@attrs.frozen
class ScoreRequest(PoolingBase):
    """POST /score: text_1 against text_2, one to one, one to many or many to many
    (paired); vLLM's other names for the two sides (SCORE_SIDES) too."""
    text_1: Any = opt()
    text_2: Any = opt()
    queries: Any = opt()
    documents: Any = opt()
    items: Any = opt()
    data_1: Any = opt()
    data_2: Any = opt()
    use_activation: bool | None = opt()


@attrs.frozen
class RerankRequest(PoolingBase):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape)."""
    query: Any = opt()
    documents: Any = opt()
    top_n: int | None = opt()
    return_documents: bool = opt(default=True)
    use_activation: bool | None = opt()
    max_tokens_per_doc: int | None = opt()       # Cohere's: each document cut to this many tokens


@attrs.frozen
class ClassifyRequest(PoolingBase):
    """POST /classify: `input` as for embeddings, or vLLM's chat-style `messages`."""
    input: Any = opt()
    messages: list[ChatMessage] | None = opt()
    use_activation: bool | None = opt()
    add_special_tokens: bool | None = opt()   # default: true for input, false for messages
    chat_template: str | None = opt()
    chat_template_kwargs: dict[str, Any] | None = opt()
    add_generation_prompt: bool = opt(default=False)
    continue_final_message: bool = opt(default=False)


# -- the plan ----------------------------------------------------------------------------


@attrs.frozen
class PoolingInput:
    """One sequence to pool: a text, token ids, or a text pair (a cross-encoder's)."""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    pair: tuple[str, str] | None = None
    param: str = "input"                 # the field it came from, for a 400 naming it
    add_special_tokens: bool = True
    max_tokens: int | None = None        # keep this many tokens (truncate_prompt_tokens)


@attrs.frozen
class PoolingPlan:
    inputs: tuple[PoolingInput, ...]
    options: PoolingOptions
    reply: PoolingReply
    messages: tuple[ChatMessage, ...] | None = None   # embeddings' chat-style input
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    add_generation_prompt: bool = False
    continue_final_message: bool = False


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _inputs(value: object, param: str, *, add_special_tokens: bool, max_tokens: int | None,
            allow_ids: bool = True) -> list[PoolingInput]:
    """A string, a list of strings, token ids or a list of token-id lists -> inputs."""
    kw = dict(add_special_tokens=add_special_tokens, max_tokens=max_tokens)
    if isinstance(value, str):
        return [PoolingInput(text=value, param=param, **kw)]
    if allow_ids and _is_ids(value):
        return [PoolingInput(token_ids=tuple(value), param=param, **kw)]
    if not isinstance(value, list) or not value:
        what = "a string, an array of strings" + (", token ids or arrays of token ids" if allow_ids else "")
        raise RequestError(f"'{param}' must be {what}, and not empty.", param=param)
    out = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if isinstance(item, str):
            out.append(PoolingInput(text=item, param=where, **kw))
        elif allow_ids and _is_ids(item):
            out.append(PoolingInput(token_ids=tuple(item), param=where, **kw))
        else:
            what = "a string" + (" or a non-empty array of token ids" if allow_ids else "")
            raise RequestError(f"'{where}' must be {what}.", param=where)
    if len(out) > MAX_INPUTS:
        raise RequestError(f"'{param}' holds {len(out)} inputs; at most {MAX_INPUTS} per request.", param=param)
    return out


def _texts(value: object, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return list(value)
    raise RequestError(f"'{param}' must be a string or a non-empty array of strings.", param=param)


def _dimensions(req: EmbeddingRequest, spec: PoolingSpec) -> int | None:
    if req.dimensions is None:
        return None
    try:
        check_dimensions(req.dimensions, spec.hidden_size, spec.matryoshka, "'dimensions'")
    except PoolingConfigError as e:
        raise RequestError(str(e), param="dimensions") from None
    return req.dimensions


def plan_embeddings(req: EmbeddingRequest, spec: PoolingSpec, kind: str = "embeddings") -> PoolingPlan:
    """/v1/embeddings and /pooling."""
    if spec.task != "embed" and kind == "embeddings":
        raise RequestError("This model is a classifier: it serves /classify, /score and /rerank, "
                           "not embeddings.", param="model")
    if (req.input is None) == (req.messages is None):
        raise RequestError("Send exactly one of 'input' and 'messages'.", param="input")
    reply = PoolingReply(kind=kind, encoding_format=req.encoding_format)
    options = PoolingOptions(dimensions=_dimensions(req, spec), normalize=req.normalize)
    if req.messages is not None:
        return _messages_plan(req, options, reply)
    inputs = _inputs(req.input, "input", add_special_tokens=req.add_special_tokens is not False,
                     max_tokens=req.truncate_prompt_tokens)
    return PoolingPlan(inputs=tuple(inputs), options=options, reply=reply)


def plan_classify(req: ClassifyRequest, spec: PoolingSpec) -> PoolingPlan:
    if spec.task != "classify":
        raise RequestError("This model is an embedding model: it has no classification head "
                           "(serve a ...ForSequenceClassification, or --convert classify).", param="model")
    options = PoolingOptions(use_activation=req.use_activation)
    reply = PoolingReply(kind="classify", labels=spec.labels)
    if (req.input is None) == (req.messages is None):
        raise RequestError("Send exactly one of 'input' and 'messages'.", param="input")
    if req.messages is not None:
        return _messages_plan(req, options, reply)
    inputs = _inputs(req.input, "input", add_special_tokens=req.add_special_tokens is not False,
                     max_tokens=req.truncate_prompt_tokens)
    return PoolingPlan(inputs=tuple(inputs), options=options, reply=reply)


def _messages_plan(req: EmbeddingRequest | ClassifyRequest, options: PoolingOptions,
                   reply: PoolingReply) -> PoolingPlan:
    """vLLM's chat-style input: one sequence, the messages through the chat template."""
    if not req.messages:
        raise RequestError("'messages' must be a non-empty array of messages.", param="messages")
    return PoolingPlan(
        inputs=(PoolingInput(param="messages", max_tokens=req.truncate_prompt_tokens,
                             add_special_tokens=bool(req.add_special_tokens)),),
        options=options, reply=reply, messages=tuple(req.messages), chat_template=req.chat_template,
        template_kwargs=dict(req.chat_template_kwargs or {}), add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message)


def _score_plan(left: list[str], right: list[str], spec: PoolingSpec, *, truncate: int | None,
                use_activation: bool | None, kind: str, names: tuple[str, str],
                documents: tuple[str, ...] = (), top_n: int = 0,
                right_max_tokens: int | None = None) -> PoolingPlan:
    """Pairs of left[i or 0] and right[j]: a bi-encoder embeds each text once, a
    cross-encoder runs each pair."""
    if len(left) > 1 and len(left) != len(right):
        raise RequestError(f"'{names[0]}' and '{names[1]}' must be 1 to 1, 1 to N or N to N; got "
                           f"{len(left)} and {len(right)}.", param=names[0])
    if len(right) > MAX_INPUTS:
        raise RequestError(f"'{names[1]}' holds {len(right)} texts; at most {MAX_INPUTS}.", param=names[1])
    one = len(left) == 1
    reply = PoolingReply(kind=kind, documents=documents, top_n=top_n)
    if spec.task == "classify":
        if spec.num_labels != 1:
            raise RequestError(f"Scoring needs a cross-encoder with one label; this classifier has "
                               f"{spec.num_labels}.", param="model")
        inputs = [PoolingInput(pair=(left[0 if one else j], r), param=f"{names[1]}[{j}]", max_tokens=truncate)
                  for j, r in enumerate(right)]
        return PoolingPlan(inputs=tuple(inputs), options=PoolingOptions(use_activation=use_activation),
                           reply=attrs.evolve(reply, pairs=tuple((j,) for j in range(len(right)))))
    first = [PoolingInput(text=t, param=f"{names[0]}[{i}]" if len(left) > 1 else names[0], max_tokens=truncate)
             for i, t in enumerate(left)]
    second = [PoolingInput(text=t, param=f"{names[1]}[{j}]",
                           max_tokens=right_max_tokens if right_max_tokens is not None else truncate)
              for j, t in enumerate(right)]
    n = len(first)
    pairs = tuple((0 if one else j, n + j) for j in range(len(right)))
    # cosine of normalized embeddings, whatever the model's default
    return PoolingPlan(inputs=tuple(first + second), options=PoolingOptions(normalize=True),
                       reply=attrs.evolve(reply, pairs=pairs))


def plan_score(req: ScoreRequest, spec: PoolingSpec) -> PoolingPlan:
    """The first of SCORE_SIDES' pairs the request gives both sides of (else the first it
    gives one side of: a 400 naming the other) is its two sides."""
    named = [(a, b) for a, b in SCORE_SIDES
             if getattr(req, a) is not None or getattr(req, b) is not None]
    given = next((pair for pair in named if None not in map(req.__getattribute__, pair)),
                 named[0] if named else SCORE_SIDES[0])
    left, right = (getattr(req, name) for name in given)
    if left is None or right is None:
        raise RequestError(f"'{given[0]}' and '{given[1]}' are required.",
                           param=given[0] if left is None else given[1])
    return _score_plan(_texts(left, given[0]), _texts(right, given[1]), spec,
                       truncate=req.truncate_prompt_tokens, use_activation=req.use_activation,
                       kind="score", names=given)


def plan_rerank(req: RerankRequest, spec: PoolingSpec) -> PoolingPlan:
    if not isinstance(req.query, str):
        raise RequestError("'query' must be a string.", param="query")
    docs = _documents(req.documents)
    if req.top_n is not None and req.top_n < 0:
        raise RequestError("'top_n' must be at least 0.", param="top_n")
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < 1:
        raise RequestError("'max_tokens_per_doc' must be at least 1.", param="max_tokens_per_doc")
    return _score_plan([req.query], docs, spec, truncate=req.truncate_prompt_tokens,
                       use_activation=req.use_activation, kind="rerank", names=("query", "documents"),
                       documents=tuple(docs) if req.return_documents else (), top_n=req.top_n or 0,
                       right_max_tokens=req.max_tokens_per_doc)


def _documents(value: object) -> list[str]:
    """Strings, or Cohere's objects with a text field."""
    if not isinstance(value, list) or not value:
        raise RequestError("'documents' must be a non-empty array of strings.", param="documents")
    out = []
    for i, d in enumerate(value):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise RequestError(f"'documents[{i}]' must be a string (or an object with a text).",
                               param=f"documents[{i}]")
        out.append(d)
    return out


# -- the reply ---------------------------------------------------------------------------

_PREFIX = {"embeddings": "embd", "pooling": "pool", "score": "score", "rerank": "rerank",
           "classify": "classify"}


def reply_id(kind: str, request_id: str) -> str:
    return f"{_PREFIX[kind]}-{request_id or uuid.uuid4().hex}"


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _vector(raw: bytes, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(raw).decode("ascii")
    return np.frombuffer(raw, dtype="<f4")


def _cosine(a: bytes, b: bytes) -> float:
    x, y = np.frombuffer(a, dtype="<f4").astype(np.float64), np.frombuffer(b, dtype="<f4").astype(np.float64)
    denom = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y / denom) if denom else 0.0


def scores(reply: PoolingReply, vectors: list[bytes]) -> list[float]:
    """Each pair's score: the cosine of two embeddings, or a cross-encoder's one output."""
    out = []
    for pair in reply.pairs:
        if len(pair) == 1:
            out.append(float(np.frombuffer(vectors[pair[0]], dtype="<f4")[0]))
        else:
            out.append(_cosine(vectors[pair[0]], vectors[pair[1]]))
    return out


def body(reply: PoolingReply, *, request_id: str, model: str, created: int, vectors: list[bytes],
         prompt_tokens: int) -> bytes:
    """The reply's JSON, given every sequence's vector in order."""
    rid = reply_id(reply.kind, request_id)
    usage = _usage(prompt_tokens)
    kind = reply.kind
    if kind in ("embeddings", "pooling"):
        obj = "embedding" if kind == "embeddings" else "pooling"
        key = "embedding" if kind == "embeddings" else "data"
        data = [{"index": i, "object": obj, key: _vector(v, reply.encoding_format)} for i, v in enumerate(vectors)]
        out = {"id": rid, "object": "list", "created": created, "model": model, "data": data, "usage": usage}
    elif kind == "classify":
        data = []
        for i, v in enumerate(vectors):
            probs = np.frombuffer(v, dtype="<f4")
            label = reply.labels[int(probs.argmax())] if reply.labels else str(int(probs.argmax()))
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        out = {"id": rid, "object": "list", "created": created, "model": model, "data": data, "usage": usage}
    elif kind == "score":
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores(reply, vectors))]
        out = {"id": rid, "object": "list", "created": created, "model": model, "data": data, "usage": usage}
    else:   # rerank
        ranked = sorted(enumerate(scores(reply, vectors)), key=lambda p: -p[1])
        if reply.top_n:
            ranked = ranked[:reply.top_n]
        results = []
        for i, s in ranked:
            r: dict[str, Any] = {"index": i}
            if reply.documents:
                r["document"] = {"text": reply.documents[i]}
            r["relevance_score"] = s
            results.append(r)
        out = {"id": rid, "model": model, "usage": {"prompt_tokens": prompt_tokens,
                                                    "total_tokens": prompt_tokens}, "results": results}
    return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


class PoolingFramer(Framer):
    """A pooling request's one JSON body, once every sequence has its vector: vectors are
    kept by sequence (Delta.index) as they come, whatever the order of the steps."""

    def __init__(self, req) -> None:
        super().__init__(req)
        self.vectors: list[bytes | None] = [None] * req.num_choices

    def _stream(self, delta: Delta) -> bytes:
        raise AssertionError("a pooling reply is never streamed")

    def _accumulate(self, delta: Delta) -> bytes:
        if delta.finish_reason is FinishReason.ERROR:
            self.status = 500
            return json_body(server_error(delta.error))
        self.vectors[delta.index] = delta.pooled
        if not self.closing:
            return b""
        req = self.req
        return body(req.pooling.reply, request_id=req.request_id, model=req.model, created=req.created,
                    vectors=self.vectors, prompt_tokens=req.num_prompt_tokens)


# The routes (web/app.py serves them; the first of each is the one errors name)
POOLING_PATHS: dict[str, str] = {"embeddings": "/v1/embeddings", "pooling": "/pooling", "score": "/score",
                                 "rerank": "/rerank", "classify": "/classify"}
ROUTES: dict[str, str] = {"/v1/embeddings": "embeddings", "/pooling": "pooling", "/score": "score",
                          "/v1/score": "score", "/rerank": "rerank", "/v1/rerank": "rerank",
                          "/v2/rerank": "rerank", "/classify": "classify"}

# /invocations with an `input`: embeddings, or a classifier's classes (render decides)
INVOCATION_INPUT = "input"
# /invocations with `messages`: chat on a generating model; on a pooling model, as vLLM,
# embeddings (a classifier's classes)
INVOCATION_MESSAGES = "invocation_messages"

# The APIs: name -> (request type, plan)
POOLING_APIS: dict[str, tuple[type, Any]] = {
    "embeddings": (EmbeddingRequest, plan_embeddings),
    "pooling": (EmbeddingRequest, lambda req, spec: plan_embeddings(req, spec, "pooling")),
    "score": (ScoreRequest, plan_score),
    "rerank": (RerankRequest, plan_rerank),
    "classify": (ClassifyRequest, plan_classify),
}
