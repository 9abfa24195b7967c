"""LoRA under `--tensor-parallel-size 2` on the CPU (gloo), issue 33: each rank holds its
shard of every adapter, sharded as the linear it patches (gpu/lora/adapters.py `_shard`: B's rows of
column-parallel q/k/v/gate/up, A's columns of row-parallel o/down, the partial term summed
by the layer's all-reduce), and rank 0 broadcasts each step's LoRA rows. On the tiny random
Llama (4 heads, 2 KV heads, intermediate 96: all split in two) with two PEFT adapters made
here, together on every target; the oracle is peft's merged model, the same as at -tp 1
(tests/gpu/test_lora_unit.py)."""
from __future__ import annotations

import httpx
import pytest

from tests.support.serve_processes import start
from tests.support.hf_models import make_hf_model
from tests.support.lora_adapters import hf_greedy, make_adapter

PROMPT = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1]
N = 8
ADAPTERS = {"attn": (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            "mlp": (4, ["gate_proj", "up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def tp_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-lora")
    hf = make_hf_model("llama", root / "base", tie_word_embeddings=False)
    want = {"base": hf_greedy(hf, PROMPT, N)}
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(hf, root / name, r=r, targets=targets, seed=i + 1, std=0.3)
        want[name] = hf_greedy(merged, PROMPT, N)
        assert want[name][0] != want["base"][0]
    server = start(root, str(root / "base"), "--tensor-parallel-size", "2", "--enable-lora",
                   "--max-loras", "2", "--served-model-name", "tiny", "--max-num-seqs", "4",
                   "--lora-modules", *(f"{n}={root / n}" for n in ADAPTERS))
    yield server, want
    server.stop()


def test_tp2_adapters_and_base_in_one_batch_equal_the_merged_models(tp_lora):
    import concurrent.futures

    server, want = tp_lora

    def one(model):
        r = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["token_ids"], c["logprobs"]["token_logprobs"]

    models = ["attn", "tiny", "mlp", "attn"]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(one, models))
    for model, (ids, lps) in zip(models, got):
        name = "base" if model == "tiny" else model
        assert ids == want[name][0], model
        assert max(abs(a - b) for a, b in zip(lps, want[name][1])) < 1e-3, model
