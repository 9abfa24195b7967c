"""Stream accounting against the scripted SSE server, one rule per test."""

import math

import httpx
import pytest
import trio

from web.bench.backends import CHAT, COMPLETIONS, RESPONSES, SamplingParams
from web.bench.request import request_headers, send_request

from tests.support.openai_chunks import RESPONSES_HEAD, chat_chunk, chat_usage, completion_chunk, resp, resp_done
from tests.support.sse_server import DONE, KEEPALIVE, Reply, ScriptedServer, json_reply, sse

GAP = 0.03


async def fetch(nursery, reply, backend=CHAT, prompt_len=5):
    server = await nursery.start(ScriptedServer(lambda _: reply).serve)
    payload = backend.build_payload(model="m", prompt="hi", max_tokens=8, sampling=SamplingParams())
    with trio.fail_after(10):
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
            start = trio.current_time()
            result = await send_request(client, backend, server.base_url + backend.default_endpoint, payload,
                                        request_headers("t-0", {}), prompt_len)
            wall = trio.current_time() - start
    return result, wall


def assert_timing_identity(result, token_events):
    assert result.success, result.error
    assert len(result.itls) == token_events - 1
    assert all(itl >= 0 for itl in result.itls)
    assert math.isclose(result.latency - result.ttft, sum(result.itls), rel_tol=0, abs_tol=1e-9)


async def test_chat_timing_usage_and_text(nursery):
    reply = Reply([chat_chunk(role="assistant", content=""), KEEPALIVE, GAP, KEEPALIVE, GAP,
                   chat_chunk(reasoning="think"), GAP, chat_chunk(content="Hel"), GAP, chat_chunk(content="lo"),
                   GAP, chat_chunk(finish="stop"), 0.2, chat_usage(7, 3), DONE])
    result, wall = await fetch(nursery, reply)
    assert_timing_identity(result, token_events=3)
    assert result.ttft >= 2 * GAP  # role-only chunk and keep-alives did not start the clock
    assert result.latency + 0.15 < wall  # the usage chunk after 0.2 s did not extend E2EL
    assert result.generated_text == "Hello"  # reasoning timed, not kept
    assert (result.prompt_len, result.output_tokens) == (7, 3)
    assert result.tpot == pytest.approx((result.latency - result.ttft) / 2, abs=1e-12)


async def test_chat_reasoning_field_named_reasoning_starts_ttft(nursery):
    reply = Reply([chat_chunk(role="assistant"), GAP,
                   sse({"choices": [{"index": 0, "delta": {"reasoning": "r"}}]}), GAP,
                   chat_chunk(content="x"), chat_usage(2, 2), DONE])
    result, _ = await fetch(nursery, reply)
    assert_timing_identity(result, token_events=2)
    assert result.ttft >= GAP and result.generated_text == "x"


async def test_completions_timing_and_usage(nursery):
    reply = Reply([completion_chunk(""), GAP, completion_chunk("a"), GAP, completion_chunk("b"), GAP,
                   completion_chunk("c"), completion_chunk("", finish="length"), 0.2,
                   sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}), DONE])
    result, wall = await fetch(nursery, reply, backend=COMPLETIONS)
    assert_timing_identity(result, token_events=3)
    assert result.ttft >= GAP  # an empty-text chunk is not a token
    assert result.latency + 0.15 < wall
    assert (result.generated_text, result.prompt_len, result.output_tokens) == ("abc", 9, 3)


async def test_responses_timing_usage_and_text(nursery):
    reply = Reply(RESPONSES_HEAD + [GAP, resp("response.reasoning_text.delta", delta="hmm"), GAP,
                                    resp("response.output_text.delta", delta="Hi"), GAP,
                                    resp("response.output_text.delta", delta=" there"),
                                    resp("response.output_text.done", text="Hi there"), 0.2, resp_done()])
    result, wall = await fetch(nursery, reply, backend=RESPONSES)
    assert_timing_identity(result, token_events=3)
    assert result.ttft >= GAP
    assert result.latency + 0.15 < wall
    assert (result.generated_text, result.prompt_len, result.output_tokens) == ("Hi there", 11, 4)


@pytest.mark.parametrize("terminal", [resp_done(status="incomplete"),
                                      resp_done(kind="response.incomplete", status="incomplete")])
async def test_responses_incomplete_is_success(nursery, terminal):
    reply = Reply([resp("response.output_text.delta", delta="a"), terminal])
    result, _ = await fetch(nursery, reply, backend=RESPONSES)
    assert result.success and result.output_tokens == 4 and result.prompt_len == 11


@pytest.mark.parametrize("backend,steps", [
    (CHAT, [chat_chunk(content="a"), GAP, chat_chunk(content="b"), GAP, chat_chunk(reasoning="c"), DONE]),
    (COMPLETIONS, [completion_chunk("a"), GAP, completion_chunk("b"), GAP, completion_chunk("c"), DONE]),
    (RESPONSES, [resp("response.output_text.delta", delta="a"), GAP, resp("response.output_text.delta", delta="b"),
                 GAP, resp("response.reasoning_text.delta", delta="c"), resp_done(usage=False)]),
])
async def test_without_usage_lengths_fall_back(nursery, backend, steps):
    result, _ = await fetch(nursery, Reply(steps), backend=backend, prompt_len=42)
    assert_timing_identity(result, token_events=3)
    assert result.prompt_len == 42  # the locally computed length
    assert result.output_tokens == 3  # the count of token-bearing events
    assert result.generated_text == ("abc" if backend is COMPLETIONS else "ab")  # "c" is reasoning elsewhere


async def test_http_error_status_and_message(nursery):
    reply = json_reply(400, {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}})
    result, _ = await fetch(nursery, reply)
    assert not result.success
    assert "400" in result.error and "max_tokens is too large" in result.error


@pytest.mark.parametrize("backend,steps", [
    (CHAT, [chat_chunk(role="assistant"), KEEPALIVE, chat_chunk(finish="stop"), chat_usage(3, 0), DONE]),
    (COMPLETIONS, [completion_chunk(""), DONE]),
    (RESPONSES, RESPONSES_HEAD + [resp_done()]),
])
async def test_stream_without_token_fails_mentioning_ttft(nursery, backend, steps):
    result, _ = await fetch(nursery, Reply(steps), backend=backend)
    assert not result.success and "TTFT" in result.error


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("backend,steps", [
    (CHAT, [chat_chunk(content="a"), chat_chunk(content="b", finish="stop"), chat_usage(3, 2)]),
    (COMPLETIONS, [completion_chunk("a"), completion_chunk("b")]),
    (RESPONSES, [resp("response.output_text.delta", delta="a"), resp("response.output_text.done", text="a")]),
])
async def test_stream_cut_before_terminal_event_fails(nursery, backend, steps, truncate):
    result, _ = await fetch(nursery, Reply(steps, truncate=truncate), backend=backend)
    assert not result.success and "terminal event" in result.error


async def test_stream_cut_inside_an_event_fails(nursery):
    steps = [chat_chunk(content="a"), b'data: {"choices": [{"delta": {"cont']
    result, _ = await fetch(nursery, Reply(steps, truncate=True))
    assert not result.success and "terminal event" in result.error


@pytest.mark.parametrize("backend,error_event", [
    (CHAT, sse({"error": {"message": "engine died", "code": 500}})),
    (COMPLETIONS, sse({"error": {"message": "engine died", "code": 500}})),
    (RESPONSES, resp("error", code="server_error", message="engine died")),
    (RESPONSES, resp("response.failed", response={"status": "failed", "error": {"message": "engine died"}})),
])
@pytest.mark.parametrize("after_tokens", [False, True])
async def test_error_event_reports_server_message(nursery, backend, error_event, after_tokens):
    token = {CHAT: chat_chunk(content="a"), COMPLETIONS: completion_chunk("a"),
             RESPONSES: resp("response.output_text.delta", delta="a")}[backend]
    steps = [token, error_event] if after_tokens else [error_event]
    steps.append(DONE if backend is not RESPONSES else b"")
    result, _ = await fetch(nursery, Reply(steps), backend=backend)
    assert not result.success and "engine died" in result.error


async def test_events_split_across_chunks_mid_line_mid_json_mid_utf8(nursery):
    raw = (chat_chunk(role="assistant") + chat_chunk(content="é€😀\u2028") + chat_chunk(content="z")
           + chat_usage(1, 2) + DONE).replace(b"\n\n", b"\r\n\r\n")
    steps = []
    for i in range(0, len(raw), 7):
        steps += [raw[i : i + 7], 0.001]
    result, _ = await fetch(nursery, Reply(steps))
    assert_timing_identity(result, token_events=2)
    assert result.generated_text == "é€😀\u2028z"


async def test_connection_refused_is_a_failed_request():
    payload = CHAT.build_payload(model="m", prompt="hi", max_tokens=8, sampling=SamplingParams())
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        result = await send_request(client, CHAT, f"http://127.0.0.1:{port}/v1/chat/completions", payload,
                                    request_headers("t", {}), 3)
    assert not result.success and "Connect" in result.error
