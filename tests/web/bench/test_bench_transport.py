"""bench serve's own HTTP/1.1 client (web/bench/transport.py): framing, reuse, errors,
and the same accounting as through httpx for every scripted stream."""

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from web.bench.backends import CHAT, COMPLETIONS, RESPONSES, SamplingParams
from web.bench.request import request_headers, send_request
from web.bench.transport import ChunkedDecoder, StreamClient

from tests.support.sse_server import (DONE, KEEPALIVE, LocalServer, Reply, ScriptedServer, json_reply, read_request,
                                      split_at, sse)
from tests.support.openai_chunks import RESPONSES_HEAD, chat_chunk, chat_usage, completion_chunk, resp, resp_done


def encode_chunked(pieces, extension=b"", trailer=b""):
    body = b"".join(b"%x%s\r\n" % (len(p), extension) + p + b"\r\n" for p in pieces if p)
    return body + b"0\r\n" + trailer + b"\r\n"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8), st.lists(st.integers(0, 10_000), max_size=12),
       st.sampled_from([b"", b";ext=1", b" ; name"]), st.sampled_from([b"", b"x-trailer: 1\r\n"]))
def test_chunked_decoding_in_any_split(pieces, cuts, extension, trailer):
    decoder = ChunkedDecoder()
    out = b"".join(decoder.feed(part) for part in split_at(encode_chunked(pieces, extension, trailer), cuts))
    assert out == b"".join(pieces)
    assert decoder.done and decoder.extra == b""


def test_chunked_stops_at_the_last_chunk():
    decoder = ChunkedDecoder()
    assert decoder.feed(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1") == b"abc"
    assert decoder.done and decoder.extra == b"HTTP/1.1"


@pytest.mark.parametrize("raw", [b"zz\r\nabc\r\n", b"3\r\nabcX\r\n", b"-3\r\nabc\r\n"])
def test_malformed_chunked_body_raises(raw):
    with pytest.raises(httpx.RemoteProtocolError):
        ChunkedDecoder().feed(raw)


def steps_for(raw: bytes, piece: int):
    steps = []
    for i in range(0, len(raw), piece):
        steps += [raw[i : i + piece], 0.001]
    return steps


# Streams from tests/web/bench/test_bench_accounting.py, plus errors and cuts; each gives the
# same result through httpx and through StreamClient.
SCRIPTS = [
    (CHAT, Reply([chat_chunk(role="assistant", content=""), KEEPALIVE, 0.01, chat_chunk(reasoning="think"),
                  0.01, chat_chunk(content="Hel"), 0.01, chat_chunk(content="lo"), chat_chunk(finish="stop"),
                  chat_usage(7, 3), DONE])),
    (CHAT, Reply(steps_for(chat_chunk(content="é€😀\u2028") + chat_chunk(content="z") + chat_usage(1, 2) + DONE, 7))),
    (COMPLETIONS, Reply([completion_chunk(""), completion_chunk("a"), completion_chunk("b"),
                         sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}), DONE])),
    (RESPONSES, Reply(RESPONSES_HEAD + [resp("response.output_text.delta", delta="Hi"),
                                        resp("response.output_text.delta", delta=" there"), resp_done()])),
    (CHAT, json_reply(400, {"error": {"message": "max_tokens is too large"}})),
    (CHAT, Reply([chat_chunk(content="a"), b'data: {"choices": [{"delta": {"cont'], truncate=True)),
    (COMPLETIONS, Reply([completion_chunk("a"), completion_chunk("b")], truncate=True)),
    (COMPLETIONS, Reply([completion_chunk("a"), completion_chunk("b")])),
    (CHAT, Reply([chat_chunk(content="a"), sse({"error": {"message": "engine died"}}), DONE])),
]


@pytest.mark.parametrize("backend,reply", SCRIPTS)
async def test_same_result_as_httpx(nursery, backend, reply):
    server = await nursery.start(ScriptedServer(lambda _: reply).serve)
    payload = backend.build_payload(model="m", prompt="hi", max_tokens=8, sampling=SamplingParams())
    url = server.base_url + backend.default_endpoint
    results = []
    with trio.fail_after(10):
        for client in (httpx.AsyncClient(trust_env=False, timeout=5), StreamClient(read_timeout=5)):
            async with client:
                results.append(await send_request(client, backend, url, payload, request_headers("t", {}), 5))
    via_httpx, via_raw = results
    assert (via_raw.success, via_raw.generated_text, via_raw.output_tokens, via_raw.prompt_len, len(via_raw.itls)) \
        == (via_httpx.success, via_httpx.generated_text, via_httpx.output_tokens, via_httpx.prompt_len,
            len(via_httpx.itls))
    # The error names the same cause (the exception types are httpx's; messages may differ).
    assert via_raw.error.split(":")[0] == via_httpx.error.split(":")[0]
    assert server.received[0].body == server.received[1].body


class KeepAliveServer(LocalServer):
    """Answers every request on a connection with a small chunked SSE body, without
    ``Connection: close``. ``drop`` "idle": the server closes each connection once it
    has answered; "next": it closes it, silently, on the second request it receives."""

    def __init__(self, drop=None):
        self.drop = drop
        self.connections = 0
        self.requests = 0

    async def _handle(self, stream):
        self.connections += 1
        answered = 0
        buffer = b""
        async with stream:
            while True:
                received, buffer = await read_request(stream, buffer)
                if received is None:
                    return
                if self.drop == "next" and answered == 1:
                    return
                self.requests += 1
                answered += 1
                body = encode_chunked([sse({"choices": [{"text": "x"}]}), DONE])
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                      b"transfer-encoding: chunked\r\n\r\n" + body)
                if self.drop == "idle":
                    return


async def run_completions(client, port, n):
    payload = COMPLETIONS.build_payload(model="m", prompt="hi", max_tokens=2, sampling=SamplingParams())
    url = f"http://127.0.0.1:{port}/v1/completions"
    return [await send_request(client, COMPLETIONS, url, payload, request_headers(f"t-{i}", {}), 1) for i in range(n)]


async def test_connections_are_reused(nursery):
    server = await nursery.start(KeepAliveServer().serve)
    with trio.fail_after(10):
        async with StreamClient() as client:
            results = await run_completions(client, server.port, 3)
    assert all(r.success and r.generated_text == "x" for r in results)
    assert (server.connections, server.requests) == (1, 3)


@pytest.mark.parametrize("drop", ["idle", "next"])
async def test_a_connection_the_server_dropped_is_replaced(nursery, drop):
    """"next" is a server whose keep-alive timer runs out just as the client reuses the
    connection: the request is sent again, once, on a new one."""
    server = await nursery.start(KeepAliveServer(drop=drop).serve)
    with trio.fail_after(10):
        async with StreamClient() as client:
            results = await run_completions(client, server.port, 3)
    assert all(r.success for r in results)
    assert server.requests == 3 and server.connections == 3


async def test_read_timeout_is_a_failed_request(nursery):
    server = await nursery.start(ScriptedServer(lambda _: Reply([completion_chunk("a"), 5.0, DONE])).serve)
    payload = COMPLETIONS.build_payload(model="m", prompt="hi", max_tokens=2, sampling=SamplingParams())
    with trio.fail_after(10):
        async with StreamClient(read_timeout=0.2) as client:
            result = await send_request(client, COMPLETIONS, server.base_url + "/v1/completions", payload,
                                        request_headers("t", {}), 1)
    assert not result.success and "ReadTimeout" in result.error


async def test_connection_refused_names_connect_error():
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    async with StreamClient() as client:
        results = await run_completions(client, port, 1)
    assert not results[0].success and "ConnectError" in results[0].error


async def test_request_bytes_and_close_delimited_body(nursery):
    body = b'{"error": {"message": "no such model"}}'

    async def handle(stream):
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            received.append(data)
            await stream.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n\r\n" + body)

    received = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, handle, listeners)
    with trio.fail_after(10):
        async with StreamClient() as client:
            async with client.stream("GET", f"http://127.0.0.1:{port}/v1/models?x=1",
                                     headers={"X-Trace": "abc"}) as response:
                assert (response.status_code, await response.aread()) == (404, body)
                assert not response.reusable
    head = received[0].split(b"\r\n")
    assert head[0] == b"GET /v1/models?x=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{port}".encode() in head and b"X-Trace: abc" in head
    with pytest.raises(httpx.LocalProtocolError):
        async with StreamClient() as client:
            async with client.stream("GET", f"http://127.0.0.1:{port}/", headers={"X": "a\r\nB: c"}):
                pass
