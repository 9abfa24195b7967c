"""Disaggregated prefill under tensor parallelism (issue 36), on the CPU (gloo, NIXL over
UCX on loopback): two `tailrace serve --tensor-parallel-size 2` instances with the NIXL KV
connector, and one at TP 1. Each TP rank registers its own KV-head shard with its own NIXL
agent, the prefill instance's side channel serves every rank's layout, and the decode
instance's rank R reads the prefill instance's rank R's shard of the same blocks
(gpu/kv_transfer/connector.py).

On the tiny random Llama (4 heads, 2 KV heads: one KV head per rank) with token-id
prompts: the prefill leg on one TP 2 instance and the decode leg on the other give the
greedy tokens of a single instance (the prefill instance serving the request whole, and
the TP 1 instance), the decode instance computes the last prompt token only, and the
prefill instance frees its blocks once both ranks' reads have landed. A TP 1 instance
against a TP 2 one, either way round, is a clear error naming both sizes, and the prefill
side frees the blocks it held for it at once."""
from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time

import httpx
import pytest

from tests.support.serve_processes import metrics, start

pytest.importorskip("nixl")
from tests.support.hf_models import make_hf_model

PROMPT = [(7 * i + 3) % 150 + 1 for i in range(40)]    # 40 tokens: 3 blocks of 16
N = 6
KV_BOTH = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
FLAGS = ("--kv-transfer-config", KV_BOTH, "--served-model-name", "tiny", "--max-num-seqs",
         "2", "--block-size", "16", "--kv-cache-memory-bytes", "4Mi")
# one thread a process (five of them here); any free side-channel port (the params say it)
ENV = {"OMP_NUM_THREADS": "1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "0"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-pd")
    make_hf_model("llama", root / "model", tie_word_embeddings=False)
    names = {"prefill": 2, "decode": 2, "single": 1}
    for name in names:
        (root / name).mkdir()
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        started = {name: pool.submit(start, root / name, str(root / "model"),
                                     "--tensor-parallel-size", str(tp), *FLAGS, env=ENV)
                   for name, tp in names.items()}
        got = {}
        try:
            for name, future in started.items():
                got[name] = future.result()
            yield got
        finally:      # side by side: SIGTERM to all, then wait for each
            for server in got.values():
                server.proc.send_signal(signal.SIGTERM)
            for server in got.values():
                try:
                    server.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.proc.kill()
                    server.proc.wait()


def _complete(url: str, max_tokens: int = N, params: dict | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{url}/v1/completions", timeout=120, json=body)


def _prefill(url: str) -> dict:
    r = _complete(url, 1, {"do_remote_decode": True})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _held(url: str) -> float:
    return metrics(url)["tailrace:kv_blocks_used"]


def _wait_freed(url: str, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while _held(url) > 0:
        assert time.monotonic() < deadline, "the prefill instance still holds the blocks"
        time.sleep(0.1)


def test_tp2_prefill_and_tp2_decode_give_one_instances_greedy_tokens(servers):
    p, d, single = servers["prefill"].url, servers["decode"].url, servers["single"].url
    ref = _complete(p).json()["choices"][0]
    assert ref["token_ids"] == _complete(single).json()["choices"][0]["token_ids"]
    params = _prefill(p)
    assert params["tp_size"] == 2 and len(params["remote_block_ids"]) == 3
    assert _held(p) == 3
    before = metrics(d)
    r = _complete(d, params=params)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]
    assert got["token_ids"] == ref["token_ids"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(
        ref["logprobs"]["token_logprobs"], abs=1e-4)
    after = metrics(d)
    # the decode instance took the prompt from both ranks' reads: of its 40 tokens it
    # computed the last only (fed as a decode step is: its logits give the first token)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 40
    assert after["tailrace:cached_tokens_total"] - before["tailrace:cached_tokens_total"] == 39
    _wait_freed(p)          # rank 0 told the prefill side once both ranks' reads landed


@pytest.mark.parametrize("prefill, decode, sizes", [("single", "decode", (1, 2)),
                                                    ("prefill", "single", (2, 1))])
def test_mismatched_tp_sizes_are_a_clear_error(servers, prefill, decode, sizes):
    p, d = servers[prefill].url, servers[decode].url
    params = _prefill(p)
    assert params["tp_size"] == sizes[0]
    r = _complete(d, params=params)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert (f"runs --tensor-parallel-size {sizes[0]}, this one {sizes[1]}" in message
            and "same --tensor-parallel-size" in message), message
    _wait_freed(p, 10)      # told to free at once: it will never be read
