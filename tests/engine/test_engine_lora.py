"""LoRA through the whole in-process engine (issue 33) on a tiny random Llama: render takes
the adapter's name, schedule carries it, the runner adds its term; the oracle is peft's merged
model. Runtime load / unload (pipeline/core/lora_admin.py) under a running request, and the
refusals of a bad adapter."""
from __future__ import annotations

import json

import orjson
import pytest
import trio

from tests.support.hf_models import make_hf_model
from tests.support.lora_adapters import hf_greedy, make_adapter

from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from pipeline.core.lora_admin import load_lora_adapter, unload_lora_adapter
from stages.api.common import RequestError

PROMPT = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2]   # > 1 block


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    hf = make_hf_model("llama", root / "base", tie_word_embeddings=False, eos_token_id=None)
    (root / "base" / "config.json").write_text(json.dumps(
        {**json.loads((root / "base" / "config.json").read_text()), "eos_token_id": 159}))
    want = {"base": hf_greedy(hf, PROMPT, 6)[0]}
    for i, (name, r, targets) in enumerate((("a", 8, ["q_proj", "v_proj", "down_proj"]),
                                            ("b", 4, ["o_proj", "gate_proj", "up_proj", "k_proj"]))):
        merged = make_adapter(hf, root / name, r=r, targets=targets, seed=i, std=0.3)
        want[name] = hf_greedy(merged, PROMPT, 6)[0]
    assert want["a"] != want["base"] and want["b"] != want["base"]
    return root, want


def _cfg(root, **kw):
    return EngineConfig(model=str(root / "base"), max_model_len=128, block_size=4,
                        kv_cache_memory_bytes=8 << 20, enable_lora=True, max_loras=2,
                        enable_prompt_tokens_details=True,
                        lora_modules=[f"a={root / 'a'}", f"b={root / 'b'}"], **kw)


async def _complete(engine, model, n=6, **body):
    reply = await engine.submit("completions", {"model": model, "prompt": PROMPT, "max_tokens": n,
                                                "temperature": 0, "ignore_eos": True,
                                                "return_token_ids": True, **body})  # body wins
    return orjson.loads(await reply.read())


async def test_adapters_and_base_in_one_batch_equal_the_merged_models(tiny):
    root, want = tiny
    async with open_engine(_cfg(root)) as engine:
        base = engine.model_names[0]
        out = {}

        async def one(name):
            out[name] = await _complete(engine, base if name == "base" else name)

        async with trio.open_nursery() as nursery:
            for name in ("a", "base", "b", "a"):
                nursery.start_soon(one, name)
        for name in ("a", "b", "base"):
            assert out[name]["choices"][0]["token_ids"] == want[name], name
        assert out["a"]["model"] == "a"
        # the prefix cache is keyed by adapter (a prompt none of them has seen)
        fresh = PROMPT[::-1]

        async def cached(model):
            out = await _complete(engine, model, n=1, prompt=fresh)
            return out["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached("a") == 0
        assert await cached("a") > 0
        assert await cached("b") == 0
        assert await cached(base) == 0
        with pytest.raises(RequestError) as err:
            await _complete(engine, "nope")
        assert err.value.status == 404


async def test_runtime_load_unload_under_a_running_request(tiny, tmp_path):
    root, want = tiny
    async with open_engine(_cfg(root)) as engine:
        manager = engine.runner.lora
        with pytest.raises(RequestError) as missing:
            await load_lora_adapter(engine, "c", str(tmp_path / "none"))
        assert missing.value.status == 404
        (tmp_path / "adapter_config.json").write_text(json.dumps(
            {"r": 64, "lora_alpha": 8, "target_modules": ["q_proj"]}))
        (tmp_path / "adapter_model.safetensors").write_bytes(b"")
        with pytest.raises(RequestError, match="greater than --max-lora-rank 16") as big:
            await load_lora_adapter(engine, "c", str(tmp_path))
        assert big.value.status == 400
        assert "added" in await load_lora_adapter(engine, "c", str(root / "a"))
        with pytest.raises(RequestError, match="already been loaded"):
            await load_lora_adapter(engine, "c", str(root / "b"))
        reply = await engine.submit("completions", {
            "model": "c", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True})
        chunks = reply.__aiter__()
        first = await chunks.__anext__()
        assert "removed" in unload_lora_adapter(engine, "c")
        body = first + b"".join([c async for c in chunks])
        events = [orjson.loads(line[6:]) for line in body.split(b"\n")
                  if line.startswith(b"data: {")]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        assert len(ids) == 40 and ids[:6] == want["a"]
        with pytest.raises(RequestError) as gone:
            await _complete(engine, "c")
        assert gone.value.status == 404
        with pytest.raises(RequestError) as twice:
            unload_lora_adapter(engine, "c")
        assert twice.value.status == 404
        assert "added" in await load_lora_adapter(engine, "c", str(root / "a"))
        assert (await _complete(engine, "c"))["choices"][0]["token_ids"] == want["a"]
        unload_lora_adapter(engine, "c")
        # releases reach the runner with the next step's plan: two steps drop c's weights
        await _complete(engine, "a", n=1)
        await _complete(engine, engine.model_names[0], n=1)
        assert not manager.users and not manager.seq_lora
        assert {a.ref.name for a in manager.loaded.values()} <= {"a", "b"}
        assert engine.blocks.num_used == 0


# adapters and base rows mixed; prompts with repeats (n-gram lookup finds drafts in them)
JOBS = [("a", PROMPT), ("base", PROMPT[3:]), ("b", PROMPT), ("a", PROMPT[:6] * 3),
        ("base", PROMPT), ("b", PROMPT[5:9] * 4), ("a", PROMPT[::-1])]


async def _run_jobs(root, n=20, **kw):
    """JOBS at once, n greedy tokens each: (token ids per job, stats, what is left held).
    float32: the random model's logits are flat (near-ties), bf16 would tie differently."""
    async with open_engine(_cfg(root, dtype="float32", **kw)) as engine:
        base = engine.model_names[0]
        out: list = [None] * len(JOBS)

        async def one(i):
            name, prompt = JOBS[i]
            reply = await _complete(engine, base if name == "base" else name, n=n, prompt=prompt)
            out[i] = reply["choices"][0]["token_ids"]

        async with trio.open_nursery() as nursery:
            for i in range(len(JOBS)):
                nursery.start_soon(one, i)
        stats = engine.stats()
        # the finished sequences' releases reach the runner with the next step's plan
        await _complete(engine, base, n=1)
        manager = engine.runner.lora
        held = (engine.blocks.num_used, dict(manager.users), dict(manager.seq_lora))
        assert {a.ref.name for a in manager.loaded.values()} <= {"a", "b"}
    return out, stats, held


@pytest.fixture(scope="module")
def free_run(tiny):
    return trio.run(_run_jobs, tiny[0])


async def test_preemption_and_chunked_prefill_with_adapters_keep_outputs(tiny, free_run):
    """A KV pool too small for the batch (preemption, recompute) and a token budget under
    one prompt (chunked prefill), adapters and base rows mixed: the same tokens as a roomy
    run, nothing left held (blocks, adapter users)."""
    root, want = tiny
    free, free_stats, held = free_run
    assert held == (0, {}, {})
    assert free[0][:6] == want["a"] and free[2][:6] == want["b"] and free[4][:6] == want["base"]
    tight, stats, held = await _run_jobs(root, num_gpu_blocks_override=24,
                                         max_num_batched_tokens=8, enable_prefix_caching=False)
    assert stats.num_preemptions > 0
    assert stats.steps_total > free_stats.steps_total
    assert tight == free
    assert held == (0, {}, {})


async def test_ngram_speculation_with_adapters_is_exact(tiny, free_run):
    """n-gram drafts verified on adapters: every verify row of a sequence runs with its
    adapter (LoRAManager.prepare maps a chunk's rows, drafts included), so greedy tokens
    are those without speculation."""
    root, _ = tiny
    free, _, _ = free_run
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3, "adaptive": False}
    got, stats, held = await _run_jobs(root, speculative_config=spec)
    assert stats.spec_decode.num_drafts > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert got == free
    assert held == (0, {}, {})


async def test_draft_model_speculation_with_adapters_is_exact(tiny, free_run):
    """A draft model (the tiny base drafting for itself) proposes from base weights, for
    adapter rows too (gpu/worker/spec_decode/draft.py has no LoRA hooks): the target verifies every row with
    its adapter, so greedy tokens are those without speculation; base rows accept every
    draft, adapter rows fewer."""
    root, _ = tiny
    free, _, _ = free_run
    spec = {"method": "draft_model", "model": str(root / "base"), "num_speculative_tokens": 3,
            "adaptive": False}
    got, stats, held = await _run_jobs(root, speculative_config=spec)
    sd = stats.spec_decode
    assert sd.num_drafts > 0 and 0 < sd.num_accepted_tokens < sd.num_draft_tokens
    assert got == free
    assert held == (0, {}, {})
