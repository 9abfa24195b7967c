"""`tailrace bench throughput`: nano-vllm's workload, and a run whose steps fail."""
from __future__ import annotations

import json

import pytest

from pipeline.tools import bench
from web import cli


def _args(*argv: str):
    return cli.build_parser().parse_args(["bench", "throughput", *argv])


def test_nano_vllm_workload_draws_nano_vllms_sample():
    """Its bench.py: random.seed(0), every prompt (length, then tokens in [0, 10000]),
    then every output length; its published run generated 133,966 tokens."""
    s = bench._settings(_args("--workload", "nano-vllm"))
    reqs = bench.make_requests(s, vocab_size=151936, temperature=0.6)
    assert len(reqs) == 256
    assert sum(r["max_tokens"] for r in reqs) == bench.NANO_VLLM_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(r["prompt"]) <= 1024 and 100 <= r["max_tokens"] <= 1024 for r in reqs)
    assert max(max(r["prompt"]) for r in reqs) == 10000   # randint includes its top


def test_other_workloads_keep_their_draws():
    s = bench._settings(_args("--num-prompts", "3", "--min-input-len", "4", "--input-len", "9",
                              "--min-output-len", "2", "--output-len", "5"))
    reqs = bench.make_requests(s, vocab_size=50, temperature=0.0)
    assert [r["max_tokens"] for r in reqs] == [5, 3, 4] and [len(r["prompt"]) for r in reqs] == [7, 6, 8]


def test_failed_requests_are_reported_not_crashed_on(tmp_path, capsys):
    """The fault hook fails GPU step 2: its requests end with an error reply. The bench
    counts them, writes the first error into its JSON, and exits 1 (it used to die with
    KeyError: 'usage')."""
    out = tmp_path / "result.json"
    args = _args("--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--temperature", "0",
                 "--max-num-seqs", "1", "--fault-steps", "2", "--output-json", str(out))
    assert bench.main(args) == 1
    result = json.loads(out.read_text())
    assert result["failed_requests"] == 1 and result["num_prompts"] == 3
    assert "injected fault at step 2" in result["first_error"]
    assert result["output_tokens"] == 2 * 4
    assert "1 of 3 requests failed" in capsys.readouterr().err


def test_an_engine_that_stops_is_reported(tmp_path):
    out = tmp_path / "result.json"
    args = _args("--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                 "--fault-steps", "1:fatal", "--output-json", str(out))
    assert bench.main(args) == 1
    result = json.loads(out.read_text())
    assert result["failed_requests"] == 2
    assert "injected fatal fault at step 1" in result["first_error"]


def test_an_interrupted_run_says_how_far_it_got(tmp_path, monkeypatch):
    """gpu_check stops the run with SIGINT at its time limit: the JSON still comes out."""
    def interrupted(fn, cfg, s, temperature, so_far):
        so_far.update(done=5, output_tokens=640, failures=["HTTP 500: boom"], t0=bench.time.perf_counter())
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.trio, "run", interrupted)
    out = tmp_path / "result.json"
    assert bench.main(_args("--num-prompts", "8", "--output-json", str(out))) == 1
    result = json.loads(out.read_text())
    assert result["interrupted"] and result["completed_requests"] == 5 and result["output_tokens"] == 640
    assert result["first_error"] == "HTTP 500: boom" and result["stage"] == "running requests"
