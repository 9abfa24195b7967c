"""Payloads, headers and the configurations refused before anything is sent."""

import argparse

import pytest
import trio

from web.bench import serve
from web.bench.backends import BenchConfigError
from web.bench.datasets import SampleRequest

from tests.support.sse_server import DONE, Reply, ScriptedServer, sse


def parse_args(*argv):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def config(*argv):
    return serve.build_config(parse_args(*argv))


def echo_script(received):
    backend = received.path
    if backend.endswith("/responses"):
        return Reply([sse({"type": "response.output_text.delta", "delta": "x"}),
                      sse({"type": "response.completed", "response": {"status": "completed"}})])
    if backend.endswith("/chat/completions"):
        return Reply([sse({"choices": [{"delta": {"content": "x"}}]}), DONE])
    return Reply([sse({"choices": [{"text": "x"}]}), DONE])


async def sent_requests(nursery, *argv):
    server = await nursery.start(ScriptedServer(echo_script).serve)
    cfg = config("--base-url", server.base_url, "--disable-tqdm", *argv)
    samples = [SampleRequest(prompt=f"prompt {i}", prompt_len=2, expected_output_len=5 + i) for i in range(2)]
    with trio.fail_after(10):
        outcome = await serve.run_benchmark(cfg, samples)
    assert all(r.success for r in outcome.results)
    return sorted(server.received, key=lambda r: r.headers["x-request-id"])


async def test_responses_payload_is_exact(nursery):
    received = await sent_requests(nursery, "--backend", "openai-responses", "--model", "big/model",
                                   "--served-model-name", "served", "--ignore-eos", "--temperature", "0.5",
                                   "--top-k", "3")
    assert received[0].path == "/v1/responses"
    assert received[0].json() == {"model": "served", "input": "prompt 0", "max_output_tokens": 5, "stream": True,
                                  "store": False, "ignore_eos": True, "temperature": 0.5, "top_k": 3}
    assert received[1].json()["max_output_tokens"] == 6


async def test_responses_payload_without_optional_fields(nursery):
    received = await sent_requests(nursery, "--backend", "openai-responses", "--model", "m")
    assert received[0].json() == {"model": "m", "input": "prompt 0", "max_output_tokens": 5, "stream": True,
                                  "store": False}


async def test_chat_payload_and_headers(nursery):
    received = await sent_requests(
        nursery, "--backend", "openai-chat", "--model", "m", "--min-p", "0.1", "--top-p", "0.9",
        "--frequency-penalty", "0.2", "--presence-penalty", "0.3", "--repetition-penalty", "1.1",
        "--sampling-seed", "7", "--extra-body", '{"chat_template_kwargs": {"x": 1}, "top_p": 0.8}',
        "--header", "X-Trace=abc", "--header", "X-Other=a=b", "--request-id-prefix", "run7-")
    first = received[0]
    assert first.path == "/v1/chat/completions"
    assert first.json() == {
        "model": "m", "messages": [{"role": "user", "content": "prompt 0"}], "max_completion_tokens": 5,
        "stream": True, "stream_options": {"include_usage": True}, "min_p": 0.1, "top_p": 0.8,
        "frequency_penalty": 0.2, "presence_penalty": 0.3, "repetition_penalty": 1.1, "seed": 7,
        "chat_template_kwargs": {"x": 1},
    }
    assert [r.headers["x-request-id"] for r in received] == ["run7-0", "run7-1"]
    for r in received:
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-trace"] == "abc" and r.headers["x-other"] == "a=b"


async def test_completions_payload(nursery):
    received = await sent_requests(nursery, "--backend", "openai-completions", "--model", "m", "--ignore-eos")
    assert received[0].path == "/v1/completions"
    assert received[0].json() == {"model": "m", "prompt": "prompt 0", "max_tokens": 5, "stream": True,
                                  "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert received[0].headers["x-request-id"] == serve.DEFAULT_REQUEST_ID_PREFIX + "0"


@pytest.mark.parametrize("alias", ["openai", "vllm"])
async def test_vllm_names_for_the_completions_backend(nursery, alias):
    """`vllm bench serve --backend vllm ...` copied as it is runs the completions backend."""
    assert config("--backend", alias).backend is config("--backend", "openai-completions").backend
    received = await sent_requests(nursery, "--backend", alias, "--model", "m", "--ignore-eos")
    assert received[0].path == "/v1/completions"
    assert received[0].json()["prompt"] == "prompt 0"
    with pytest.raises(BenchConfigError, match="/v1/completions"):
        config("--backend", alias, "--endpoint", "/v1/chat/completions")


async def test_model_discovered_from_server_when_not_given(nursery):
    def script(received):
        if received.path == "/v1/models":
            from tests.support.sse_server import json_reply
            return json_reply(200, {"object": "list", "data": [{"id": "default-model", "object": "model"}]})
        return echo_script(received)

    server = await nursery.start(ScriptedServer(script).serve)
    cfg = config("--base-url", server.base_url, "--disable-tqdm")
    outcome = await serve.run_benchmark(cfg, [SampleRequest("p", 1, 2)])
    assert outcome.model == "default-model"
    assert server.received[-1].json()["model"] == "default-model"


@pytest.mark.parametrize("backend,endpoint,expected", [
    ("openai-responses", "/v1/chat/completions", "/v1/responses"),
    ("openai-chat", "/v1/completions", "/v1/chat/completions"),
    ("openai-completions", "/v1/chat/completions", "/v1/completions"),
    ("openai-chat", "/v1/responses", "/v1/chat/completions"),
])
def test_endpoint_that_does_not_fit_backend_is_refused(backend, endpoint, expected):
    with pytest.raises(BenchConfigError, match=expected):
        config("--backend", backend, "--endpoint", endpoint)


def test_custom_endpoint_fitting_backend_is_accepted():
    cfg = config("--backend", "openai-chat", "--endpoint", "/proxy/v1/chat/completions", "--host", "h", "--port", "9")
    assert cfg.url == "http://h:9/proxy/v1/chat/completions"


@pytest.mark.parametrize("argv,message", [
    (["--backend", "openai-responses", "--min-p", "0.1"], "--min-p"),
    (["--backend", "openai-responses", "--endpoint", "/v1/completions"], "/v1/responses"),
    (["--extra-body", "[1]"], "JSON object"),
    (["--extra-body", "{nope"], "not valid JSON"),
    (["--header", "novalue"], "KEY=VALUE"),
    (["--goodput", "ttft:abc"], "milliseconds"),
    (["--goodput", "latency:5"], "ttft"),
    (["--percentile-metrics", "ttft,foo"], "foo"),
    (["--metric-percentiles", "0"], "percentile"),
    (["--request-rate", "0"], "request-rate"),
    (["--dataset-name", "sharegpt"], "dataset-path"),
])
def test_refused_configurations_exit_2_before_sending(argv, message, capsys, monkeypatch):
    def no_tokenizer(_):
        raise AssertionError("loaded a tokenizer for a refused configuration")

    monkeypatch.setattr(serve, "_load_tokenizer", no_tokenizer)
    # Port 9 on a closed host: any request sent would fail rather than hang, but none should be sent.
    assert serve.main(parse_args("--port", "9", *argv)) == 2
    assert message in capsys.readouterr().err


def test_min_p_is_accepted_for_chat_and_completions():
    assert config("--backend", "openai-chat", "--min-p", "0.1").sampling.min_p == 0.1
    assert config("--backend", "openai-completions", "--min-p", "0.1").sampling.min_p == 0.1


def test_arrival_offsets():
    assert serve.arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    offsets = serve.arrival_offsets(2000, 100.0, 1.0, 1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    mean_gap = offsets[-1] / 1999
    assert mean_gap == pytest.approx(0.01, rel=0.1)
    bursty = serve.arrival_offsets(2000, 100.0, 0.25, 1)
    assert bursty[-1] / 1999 == pytest.approx(0.01, rel=0.2)  # same rate, different shape
    assert serve.arrival_offsets(5, 10.0, 1.0, 3) == serve.arrival_offsets(5, 10.0, 1.0, 3)


async def test_max_concurrency_bounds_requests_in_flight(nursery):
    in_flight = 0
    peak = 0

    class Counting(ScriptedServer):
        async def _handle(self, stream):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await super()._handle(stream)
            finally:
                in_flight -= 1

    def slow(received):
        return Reply([0.05, sse({"choices": [{"text": "x"}]}), DONE])

    server = await nursery.start(Counting(slow).serve)
    cfg = config("--base-url", server.base_url, "--disable-tqdm", "--model", "m", "--max-concurrency", "2")
    with trio.fail_after(10):
        outcome = await serve.run_benchmark(cfg, [SampleRequest("p", 1, 2)] * 6)
    assert all(r.success for r in outcome.results)
    assert peak == 2
