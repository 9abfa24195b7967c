"""SSE events as OpenAI-compatible servers stream them (chat and completion chunks, usage,
Responses events), for the bench tests' scripted servers (tests/web/bench/test_bench_accounting.py,
test_bench_transport.py)."""

from tests.support.sse_server import sse

def chat_chunk(content=None, reasoning=None, role=None, finish=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    return sse({"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def chat_usage(prompt, completion):
    return sse({"id": "c", "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                    "total_tokens": prompt + completion}})


def completion_chunk(text, finish=None):
    return sse({"id": "k", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def resp(kind, **fields):
    return sse({"type": kind, **fields}, event=kind)


def resp_done(kind="response.completed", status="completed", usage=True):
    response = {"id": "r", "status": status}
    if usage:
        response["usage"] = {"input_tokens": 11, "output_tokens": 4, "total_tokens": 15}
    return resp(kind, response=response)


RESPONSES_HEAD = [resp("response.created", response={"id": "r", "status": "in_progress"}),
                  resp("response.in_progress", response={"id": "r", "status": "in_progress"}),
                  resp("response.output_item.added", item={"type": "message"})]
