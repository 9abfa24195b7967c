"""emit core: byte-exact framing for chat, completions and the Responses API."""
import attrs
import orjson
import pytest

from gpu.interface import SamplingOptions
from stages.delta import Delta, FinishReason, TokenLogprob, Usage
from stages.messages import SamplingParams
from stages.api.chat import ChatFramer
from stages.api.completions import CompletionFramer
from stages.api.framing import STATUS_CLIENT_CLOSED
from stages.api.responses_framing import ResponsesFramer
from stages.emit import framer_for as Framer
from tests.support.rendered import rendered

CREATED = 1700000000


def request(api, *, stream=False, include_usage=False, body=None, request_id="abc"):
    return rendered(request_id, api=api, stream=stream, include_usage=include_usage, body=body,
                    model="tiny", created=CREATED, temperature=0.5, top_p=0.9)


def delta(content="", reasoning="", finish=None, prompt=3, completion=1, reasoning_tokens=0,
          stop_reason=None, error=None):
    return Delta("abc", (7,), finish, stop_reason, error=error, content=content,
                 reasoning=reasoning,
                 usage=Usage(prompt, completion, cached_tokens=0,
                             reasoning_tokens=reasoning_tokens))


def sse(obj):
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# no prompt_tokens_details: that needs --enable-prompt-tokens-details (as vLLM); no
# completion_tokens_details without a reasoning parser (as vLLM)
USAGE_3_2 = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def with_parser(req, **reply):
    """`req` as rendered on a server with a reasoning parser (its usage has
    completion_tokens_details), and `reply`'s ReplySpec fields."""
    return attrs.evolve(req, reply=attrs.evolve(req.reply, reasoning_details=True, **reply))


def chat_chunk(choices, **extra):
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": CREATED,
            "model": "tiny", "choices": choices, **extra}


def test_framer_dispatches_on_api():
    assert type(Framer(request("chat"))) is ChatFramer
    assert type(Framer(request("completions"))) is CompletionFramer
    assert type(Framer(request("responses"))) is ResponsesFramer
    with pytest.raises(ValueError):
        Framer(attrs.evolve(request("chat"), api="embeddings"))


# -- chat ----------------------------------------------------------------------

def test_chat_stream_bytes():
    f = Framer(request("chat", stream=True))
    assert f.start() == sse(chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
    assert f.on_delta(delta("Hel")) == sse(chat_chunk([
        {"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}]))
    assert f.on_delta(delta("")) == b""          # nothing new (held back by stop strings)
    assert not f.finished
    out = f.on_delta(delta("lo", finish=FinishReason.STOP, completion=2, stop_reason=None))
    assert out == (
        sse(chat_chunk([{"index": 0, "delta": {"content": "lo"}, "logprobs": None,
                         "finish_reason": None}]))
        + sse(chat_chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                           "stop_reason": None}]))
        + b"data: [DONE]\n\n")
    assert f.finished
    assert f.on_delta(delta("late")) == b""


def test_chat_stream_include_usage_and_reasoning():
    f = Framer(with_parser(request("chat", stream=True, include_usage=True)))
    f.start()
    assert f.on_delta(delta(reasoning="hmm")) == sse(chat_chunk([
        {"index": 0, "delta": {"content": "", "reasoning": "hmm"}, "logprobs": None,
         "finish_reason": None}], usage=None))
    out = f.on_delta(delta(finish=FinishReason.LENGTH, completion=2, stop_reason=None,
                           reasoning_tokens=1))
    assert out == (
        sse(chat_chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                         "stop_reason": None}], usage=None))
        + sse(chat_chunk([], usage={**USAGE_3_2,
                                    "completion_tokens_details": {"reasoning_tokens": 1}}))
        + b"data: [DONE]\n\n")


def test_chat_include_reasoning_false_hides_reasoning():
    f = Framer(request("chat", stream=True, body={"include_reasoning": False}))
    assert f.on_delta(delta(reasoning="secret")) == b""


def _hidden_reply(stream, hide):
    """include_reasoning false, logprobs and return_token_ids asked for, on a server with a
    parser (`hide`: render's ReplySpec.hide_token_metadata) or without."""
    req = attrs.evolve(request("chat", stream=stream, body={"include_reasoning": False,
                                                           "return_token_ids": True,
                                                           "logprobs": True}),
                       sampling=SamplingParams(max_tokens=8, options=SamplingOptions(logprobs=0)))
    req = with_parser(req, hide_token_metadata=True) if hide else req
    lp = lambda *tokens: tuple(TokenLogprob(t, -0.5) for t in tokens)   # noqa: E731
    f = Framer(req)
    out = f.start()
    out += f.on_delta(attrs.evolve(delta(reasoning="se"), token_ids=(11, 12),
                                   logprobs=lp("s", "e"), reasoning_span=2))
    out += f.on_delta(attrs.evolve(
        delta("answer", reasoning="ret", finish=FinishReason.STOP, completion=6),
        token_ids=(14, 99, 21, 22), logprobs=lp("ret", "</think>", "ans", "wer"),
        reasoning_span=2))
    if stream:
        chunks = [orjson.loads(line[6:]) for line in out.split(b"\n\n")
                  if line.startswith(b"data: {")]
        choices = [ch for c in chunks for ch in c["choices"]]
        ids = [t for ch in choices for t in ch.get("token_ids") or ()]
        tokens = [t["token"] for ch in choices if ch["logprobs"]
                  for t in ch["logprobs"]["content"]]
        return out, ids, tokens, chunks[0].get("prompt_token_ids"), any(
            "token_ids" in ch or ch["logprobs"] is not None for ch in choices)
    body = orjson.loads(out)
    choice = body["choices"][0]
    tokens = [t["token"] for t in (choice["logprobs"] or {"content": []})["content"]]
    return out, choice["token_ids"] or [], tokens, body["prompt_token_ids"], (
        choice["token_ids"] is not None or choice["logprobs"] is not None)


@pytest.mark.parametrize("stream", [True, False])
def test_include_reasoning_false_with_a_parser_drops_every_logprob_and_token_id(stream):
    """As vLLM's chat serving (hide_stream_metadata, streamed; suppress_metadata, not):
    include_reasoning false with a parser on sends no logprobs and no token ids for any
    token, the answer's included (`logprobs` and `token_ids` null in the body, absent from
    every chunk), so that the hidden reasoning cannot be decoded from them. The prompt's
    ids (return_token_ids) are still sent, as vLLM."""
    out, ids, tokens, prompt_ids, any_metadata = _hidden_reply(stream, hide=True)
    assert b'"reasoning"' not in out and b"ret" not in out and b"answer" in out
    assert ids == [] and tokens == [] and not any_metadata
    assert prompt_ids == [1, 2, 3]


@pytest.mark.parametrize("stream", [True, False])
def test_include_reasoning_false_without_a_parser_keeps_the_logprobs(stream):
    """Without a parser there is no reasoning to hide: every token's logprob and id is
    sent, as vLLM (whose hiding needs a parser)."""
    out, ids, tokens, _, _ = _hidden_reply(stream, hide=False)
    assert ids == [11, 12, 14, 99, 21, 22]
    assert tokens == ["s", "e", "ret", "</think>", "ans", "wer"]


def test_chat_stream_error_and_abort():
    f = Framer(request("chat", stream=True))
    out = f.on_delta(delta(finish=FinishReason.ERROR, error="CUDA fell over"))
    assert out == (sse({"error": {"message": "CUDA fell over", "type": "server_error",
                                  "param": None, "code": None}}) + b"data: [DONE]\n\n")
    assert f.finished
    f = Framer(request("chat", stream=True))
    assert f.on_delta(delta("x", finish=FinishReason.ABORT)) == b""
    assert f.finished and f.status == STATUS_CLIENT_CLOSED


def test_chat_non_stream_body():
    f = Framer(request("chat"))
    assert f.start() == b""
    assert f.on_delta(delta("Hel", reasoning="r")) == b""
    body = f.on_delta(delta("lo", finish=FinishReason.STOP, completion=2, stop_reason="</s>"))
    assert f.finished and f.status == 200
    assert orjson.loads(body) == {
        "id": "chatcmpl-abc", "object": "chat.completion", "created": CREATED, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello",
                                             "refusal": None, "reasoning": "r"},
                     "logprobs": None, "finish_reason": "stop", "stop_reason": "</s>",
                     "token_ids": None}],
        "usage": USAGE_3_2, "prompt_logprobs": None, "prompt_token_ids": None}


def test_non_stream_error_is_500_json():
    f = Framer(request("chat"))
    body = f.on_delta(delta(finish=FinishReason.ERROR, error="boom"))
    assert f.status == 500
    assert orjson.loads(body)["error"]["message"] == "boom"


# -- completions ---------------------------------------------------------------

def cmpl_chunk(choices, **extra):
    return {"id": "cmpl-abc", "object": "text_completion", "created": CREATED, "model": "tiny",
            "choices": choices, **extra}


def test_completion_stream_bytes():
    f = Framer(request("completions", stream=True, include_usage=True))
    assert f.start() == b""
    assert f.on_delta(delta(" Paris")) == sse(cmpl_chunk(
        [{"index": 0, "text": " Paris", "logprobs": None, "finish_reason": None}], usage=None))
    out = f.on_delta(delta(finish=FinishReason.STOP, completion=2, stop_reason=13))
    assert out == (
        sse(cmpl_chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop",
                         "stop_reason": 13}], usage=None))
        + sse(cmpl_chunk([], usage=USAGE_3_2))
        + b"data: [DONE]\n\n")


def test_completion_non_stream_body():
    f = Framer(request("completions"))
    f.on_delta(delta("a", reasoning="ignored"))
    body = orjson.loads(f.on_delta(delta("b", finish=FinishReason.LENGTH, completion=2)))
    assert body == {"id": "cmpl-abc", "object": "text_completion", "created": CREATED,
                    "model": "tiny",
                    "choices": [{"index": 0, "text": "ab", "logprobs": None,
                                 "finish_reason": "length", "stop_reason": None,
                                 "prompt_logprobs": None, "prompt_token_ids": None,
                                 "token_ids": None}],
                    "usage": USAGE_3_2}


# -- responses -----------------------------------------------------------------

RESP_BODY = {"instructions": "be nice", "max_output_tokens": 8}


def events(raw):
    """Parse SSE bytes into (event, data) pairs, checking the framing as it goes."""
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        event_line, data_line = block.split(b"\n")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        data = orjson.loads(data_line[len(b"data: "):])
        assert data["type"] == event_line[len(b"event: "):].decode()
        out.append(data)
    assert raw.endswith(b"\n\n") or raw == b""
    return out


def run_stream(framer, deltas):
    raw = framer.start() + b"".join(framer.on_delta(d) for d in deltas)
    evs = events(raw)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    return evs


def test_responses_stream_plain_text():
    f = Framer(request("responses", stream=True, body=RESP_BODY))
    evs = run_stream(f, [delta("Hel"), delta("lo", finish=FinishReason.STOP, completion=2)])
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    created = evs[0]["response"]
    assert created["id"] == "resp_abc" and created["status"] == "in_progress"
    assert created["output"] == [] and created["usage"] is None
    assert created["instructions"] == "be nice" and created["max_output_tokens"] == 8
    assert evs[2]["item"] == {"id": "msg_abc", "type": "message", "status": "in_progress",
                              "role": "assistant", "content": []}
    assert [e["delta"] for e in evs[4:6]] == ["Hel", "lo"]
    assert evs[4]["item_id"] == "msg_abc" and evs[4]["output_index"] == 0
    assert evs[6]["text"] == "Hello"
    assert evs[7]["part"] == {"type": "output_text", "text": "Hello", "annotations": [],
                              "logprobs": []}
    assert evs[8]["item"]["status"] == "completed"
    done = evs[-1]["response"]
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["output"] == [evs[8]["item"]]
    assert done["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 5}
    assert f.finished


def test_responses_stream_exact_bytes_of_one_delta():
    f = Framer(request("responses", stream=True, body=RESP_BODY))
    f.start()
    f.on_delta(delta("a"))
    assert f.on_delta(delta("b")) == (
        b'event: response.output_text.delta\n'
        b'data: {"type":"response.output_text.delta","sequence_number":5,"item_id":"msg_abc",'
        b'"output_index":0,"content_index":0,"delta":"b","logprobs":[]}\n\n')


def test_responses_stream_reasoning_then_incomplete():
    f = Framer(request("responses", stream=True, body=RESP_BODY))
    evs = run_stream(f, [delta(reasoning="think"), delta(reasoning="ing"), delta("Hi"),
                         delta("!", finish=FinishReason.LENGTH, completion=8, reasoning_tokens=2)])
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.reasoning_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert evs[2]["item"]["type"] == "reasoning" and evs[2]["output_index"] == 0
    assert evs[6]["text"] == "thinking"
    assert evs[8]["item"] == {"id": "rs_abc", "type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": "thinking"}],
                              "status": "completed"}
    assert evs[9]["output_index"] == 1
    assert evs[15]["item"]["status"] == "incomplete"
    final = evs[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


def test_responses_stream_finish_without_text_still_has_a_message():
    f = Framer(request("responses", stream=True, body=RESP_BODY))
    evs = run_stream(f, [delta(finish=FinishReason.STOP, completion=1)])
    assert [e["type"] for e in evs][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_responses_stream_error():
    f = Framer(request("responses", stream=True, body=RESP_BODY))
    evs = run_stream(f, [delta("Hi"), delta(finish=FinishReason.ERROR, error="OOM")])
    assert [e["type"] for e in evs][-2:] == ["error", "response.failed"]
    assert evs[-2] == {"type": "error", "sequence_number": evs[-2]["sequence_number"],
                       "code": "server_error", "message": "OOM", "param": None}
    failed = evs[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "OOM"}
    assert failed["output"][0]["status"] == "incomplete"
    assert f.finished


def test_responses_stream_abort_is_silent():
    f = Framer(request("responses", stream=True, body=RESP_BODY))
    f.start()
    assert f.on_delta(delta("x", finish=FinishReason.ABORT)) == b""
    assert f.finished


def test_responses_non_stream_body():
    f = Framer(request("responses", body=RESP_BODY))
    assert f.start() == b""
    assert f.on_delta(delta(reasoning="hm")) == b""
    body = orjson.loads(f.on_delta(delta("Paris", finish=FinishReason.STOP, completion=2)))
    assert f.status == 200
    assert body["id"] == "resp_abc" and body["object"] == "response"
    assert body["created_at"] == CREATED and body["model"] == "tiny"
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["output"] == [
        {"id": "rs_abc", "type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}], "status": "completed"},
        {"id": "msg_abc", "type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Paris", "annotations": [],
                      "logprobs": []}]}]
    assert (body["instructions"], body["max_output_tokens"]) == ("be nice", 8)
    assert (body["temperature"], body["top_p"], body["store"]) == (0.5, 0.9, True)
    assert body["usage"]["total_tokens"] == 5


def test_responses_non_stream_incomplete_and_error():
    f = Framer(request("responses", body=RESP_BODY))
    body = orjson.loads(f.on_delta(delta("Pa", finish=FinishReason.LENGTH, completion=8)))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    f = Framer(request("responses", body=RESP_BODY))
    body = f.on_delta(delta(finish=FinishReason.ERROR, error="bad"))
    assert f.status == 500 and orjson.loads(body)["error"]["type"] == "server_error"


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_running_text_chunks_match_the_general_framing(api):
    """A running choice's text-only chunk comes from a per-choice template
    (ChunkBytes.text); it must be byte for byte what the general path frames, for any
    text (quotes, escapes, control characters, non-ASCII) and any choice."""
    texts = ['He said "hi"', "back\\slash", "tab\tnew\nline\x00\x1f", "é中🙂", "</script>", " "]
    body = {"n": 2}
    fast, slow = Framer(request(api, stream=True, body=body)), Framer(request(api, stream=True, body=body))
    slow._plain_stream = False                 # every chunk through the general path
    fast.start(), slow.start()
    for k, text in enumerate(texts):
        d = attrs.evolve(delta(text), index=k % 2)
        out = fast.on_delta(d)
        assert out == slow.on_delta(d) and out.count(b"data: ") == 1
        assert orjson.loads(out[6:])["choices"][0]["index"] == k % 2
    assert fast.on_delta(delta("")) == b""
