"""The whole runner against the scripted server, for each backend."""

import argparse
import json
import math
import subprocess
import sys

import pytest
import trio

from web.bench import serve
from web.bench.metrics import METRICS

from tests.support.sse_server import DONE, FakeTokenizer, Reply, ScriptedServer, json_reply, sse


def tokens_for(backend, n):
    if backend == "openai-responses":
        steps = []
        for i in range(n):
            steps += [sse({"type": "response.output_text.delta", "delta": f"t{i} "}), 0.002]
        usage = {"input_tokens": 8, "output_tokens": n}
        return steps + [sse({"type": "response.completed", "response": {"status": "completed", "usage": usage}})]
    steps = []
    for i in range(n):
        if backend == "openai-chat":
            steps += [sse({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}), 0.002]
        else:
            steps += [sse({"choices": [{"index": 0, "text": f"t{i} "}]}), 0.002]
    return steps + [sse({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}), DONE]


def script_for(backend):
    def script(received):
        index = int(received.headers["x-request-id"].rsplit("-", 1)[1])
        if index == 3:
            return json_reply(503, {"error": {"message": "overloaded"}})
        if index == 4:
            return Reply(tokens_for(backend, 2)[:2], truncate=True)
        return Reply(tokens_for(backend, 4))
    return script


def parse_args(*argv):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("backend", ["openai-chat", "openai-completions", "openai-responses"])
async def test_main_end_to_end_saves_summary(nursery, backend, tmp_path, monkeypatch, capsys):
    server = await nursery.start(ScriptedServer(script_for(backend)).serve)
    monkeypatch.setattr(serve, "_load_tokenizer", lambda path: FakeTokenizer())
    args = parse_args("--backend", backend, "--base-url", server.base_url, "--model", "m", "--num-prompts", "6",
                      "--random-input-len", "8", "--random-output-len", "4", "--request-rate", "200",
                      "--max-concurrency", "3", "--goodput", "ttft:10000", "e2el:10000",
                      "--metric-percentiles", "50,99", "--percentile-metrics", "ttft,tpot,itl,e2el",
                      "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "out.json",
                      "--disable-tqdm")
    with trio.fail_after(20):
        code = await trio.to_thread.run_sync(serve.main, args)
    assert code == 0
    out = capsys.readouterr()
    assert "Serving Benchmark Result" in out.out and "P50 E2EL (ms):" in out.out
    assert "overloaded" in out.err and "terminal event" in out.err

    record = json.loads((tmp_path / "out.json").read_text())
    assert record["completed"] == 4 and record["failed"] == 2
    assert record["backend"] == backend and record["model_id"] == "m"
    assert record["total_input_tokens"] == 4 * 8 and record["total_output_tokens"] == 4 * 4
    assert record["request_goodput"] == pytest.approx(4 / record["duration"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert record[key] > 0
    for m in METRICS:
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{m}_ms" in record
    assert record["output_lens"] == [4, 4, 4, 0, 0, 4]
    assert len(record["itls"]) == 6 and [len(x) for x in record["itls"]][:3] == [3, 3, 3]
    assert record["generated_texts"][0] == "t0 t1 t2 t3 "
    assert "overloaded" in record["errors"][3] and "terminal event" in record["errors"][4]
    for ttft, itls, e2el, err in zip(record["ttfts"], record["itls"], record["e2els"], record["errors"]):
        if not err:
            assert math.isclose(e2el - ttft, sum(itls), abs_tol=1e-9)
    assert [r.headers["x-request-id"] for r in sorted(server.received, key=lambda r: r.headers["x-request-id"])] \
        == [f"{serve.DEFAULT_REQUEST_ID_PREFIX}{i}" for i in range(6)]


async def test_summary_without_detail_has_no_per_request_arrays(nursery, tmp_path, monkeypatch):
    server = await nursery.start(ScriptedServer(lambda r: Reply(tokens_for("openai-chat", 2))).serve)
    monkeypatch.setattr(serve, "_load_tokenizer", lambda path: FakeTokenizer())
    args = parse_args("--backend", "openai-chat", "--base-url", server.base_url, "--model", "m", "--num-prompts",
                      "3", "--random-input-len", "4", "--save-result", "--result-dir", str(tmp_path),
                      "--disable-tqdm")
    assert await trio.to_thread.run_sync(serve.main, args) == 0
    [path] = tmp_path.glob("openai-chat-infqps-m-*.json")
    record = json.loads(path.read_text())
    assert record["completed"] == 3 and record["failed"] == 0 and "ttfts" not in record
    assert "request_goodput" not in record and record["request_rate"] == "inf"


async def test_all_failed_exits_1(nursery, monkeypatch):
    server = await nursery.start(ScriptedServer(lambda r: json_reply(500, {"error": {"message": "x"}})).serve)
    monkeypatch.setattr(serve, "_load_tokenizer", lambda path: FakeTokenizer())
    args = parse_args("--base-url", server.base_url, "--model", "m", "--num-prompts", "2", "--disable-tqdm")
    assert await trio.to_thread.run_sync(serve.main, args) == 1


async def test_request_rate_paces_sends(nursery):
    server = await nursery.start(ScriptedServer(lambda r: Reply(tokens_for("openai-completions", 1))).serve)
    cfg = serve.build_config(parse_args("--base-url", server.base_url, "--model", "m", "--request-rate", "50",
                                        "--seed", "5", "--disable-tqdm"))
    offsets = serve.arrival_offsets(5, 50.0, 1.0, 5)
    outcome = await serve.run_benchmark(cfg, [serve.datasets.SampleRequest("p", 1, 1)] * 5)
    starts = [r.start_time for r in outcome.results]
    assert outcome.duration >= offsets[-1]
    for start, offset in zip(starts, offsets):
        assert start - starts[0] >= offset - 0.05  # the first send may itself be a little late


def test_module_runs_standalone():
    proc = subprocess.run([sys.executable, "-m", "web.bench.serve", "--backend", "openai-responses", "--min-p", "0.1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--min-p" in proc.stderr
