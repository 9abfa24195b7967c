"""A hybrid linear-attention model (a tiny random Qwen3.5) through the whole engine: greedy
tokens equal to transformers' generate, and unchanged by chunked prefill at several chunk
sizes (the state carried from chunk to chunk), by preemption (the slot freed, the sequence
recomputed), by n = 2, by batching, by prefix-cache hits (resumed from the state snapshots)
and by two tensor-parallel ranks; the MoE variants' greedy tokens equal transformers'; 200 requests with disconnects leave every state slot
free; what is not served yet is refused clearly. Prefix caching is off by default for these
models (as vLLM): the tests of its hits pass --enable-prefix-caching. (The layers: tests/gpu/test_delta_rule.py;
the logits: tests/gpu/test_hybrid_models.py.)"""
from __future__ import annotations


import orjson
import pytest
import torch
import trio

from gpu.layers.attention import KVCache
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine

from tests.support.hybrid_models import TINY_EXPERTS, make_hybrid

PROMPTS = [[(i * k + 5) % 150 + 3 for i in range(n)] for k, n in ((3, 37), (5, 1), (7, 20))]
MAX_TOKENS = 16
PER_BLOCK = KVCache.bytes_per_block(1, 16, 2, 16, torch.float32)   # one full-attention layer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_tiny")
    hf = make_hybrid("qwen3_5", path, seed=5)
    want = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    return path, want


def config(path, **kw) -> EngineConfig:
    return EngineConfig(**{"model": str(path), "dtype": "float32", "max_model_len": 128,
                           "max_num_seqs": 4, **kw})


CACHED = dict(enable_prefix_caching=True)


async def generate(engine, prompts, n: int = 1) -> list[list[list[int]]]:
    """Each prompt's choices' token ids, the prompts sent at once."""
    outs = [None] * len(prompts)

    async def one(i):
        body = {"model": engine.model_names[0], "prompt": prompts[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "n": n, "return_token_ids": True}
        reply = await engine.submit("completions", body)
        choices = sorted(orjson.loads(await reply.read())["choices"], key=lambda c: c["index"])
        outs[i] = [c["token_ids"] for c in choices]
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return outs


async def test_greedy_tokens_equal_transformers_and_leave_no_slot_held(model):
    """By default (no --enable-prefix-caching): no prefix cache and no state snapshots."""
    path, want = model
    async with open_engine(config(path)) as engine:
        got = await generate(engine, PROMPTS)
        slots = engine.scheduler.state_slots
        assert slots.num_slots == 4 and slots.num_snapshots == 0 and slots.num_used == 0
        assert not engine.blocks.prefix_caching
        assert engine.cache_config["enable_prefix_caching"] == "False"
        two = await generate(engine, PROMPTS[:1], n=2)      # each choice prefills its own state
        assert slots.num_used == 0
    assert [g[0] for g in got] == want and two == [[want[0]] * 2]


async def test_prefix_cache_hits_resume_from_state_snapshots(model):
    """The same prompts again, then a next turn (the first prompt, its answer and 6 more
    tokens): each hits the cache at the prompt's last block boundary (32 of 37 tokens, 16 of
    20; the next turn at 32 too: the first prompt's snapshot), loads the linear layers'
    states kept there and gives transformers' greedy tokens; the 1-token prompt has no
    boundary to keep."""
    import transformers

    path, want = model
    turn = PROMPTS[0] + want[0] + [7, 8, 9, 10, 11, 12]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.inference_mode():
        turn_want = hf.generate(torch.tensor([turn]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(turn):].tolist()
    async with open_engine(config(path, **CACHED)) as engine:
        slots = engine.scheduler.state_slots
        assert slots.num_snapshots == 4 and engine.cache_config["enable_prefix_caching"] == "True"
        first = await generate(engine, PROMPTS)
        assert (slots.saves, slots.hits) == (2, 0)
        again = await generate(engine, PROMPTS)
        assert (slots.saves, slots.hits) == (2, 2)
        [[turn_got]] = await generate(engine, [turn])
        assert slots.hits == 3 and slots.saves == 3     # and the turn's own boundary (48 of 59)
    assert [g[0] for g in first] == [g[0] for g in again] == want
    assert turn_got == turn_want


@pytest.mark.parametrize("chunk", [5, 16])
async def test_chunked_prefill_carries_the_state(model, chunk):
    path, want = model
    async with open_engine(config(path, max_num_batched_tokens=chunk)) as engine:
        got = await generate(engine, PROMPTS)
    assert [g[0] for g in got] == want


async def test_preemption_frees_the_slot_and_recomputes(model):
    path, want = model
    # 5 blocks of 16 tokens for three sequences of up to 53 tokens: they preempt each other
    # (--kv-cache-memory-bytes counts the state pool too: 4 slots and 4 snapshots)
    from gpu.layers.linear_attention import StatePool
    from gpu.loader.decoder import load_shell

    pool = 8 * StatePool.bytes_per_slot(load_shell(str(path)).config, torch.float32)
    cfg = config(path, kv_cache_memory_bytes=pool + 5 * PER_BLOCK, max_num_batched_tokens=16, **CACHED)
    async with open_engine(cfg) as engine:
        assert engine.blocks.num_blocks == 5
        got = await generate(engine, PROMPTS)
        assert engine.stats().num_preemptions > 0
        assert engine.scheduler.state_slots.num_used == 0
    assert [g[0] for g in got] == want


async def test_two_choices_each_equal_the_greedy_tokens(model):
    path, want = model
    async with open_engine(config(path, **CACHED)) as engine:
        got = await generate(engine, PROMPTS[:1] + PROMPTS[2:], n=2)
        # each second choice loads the first's snapshot at the prompt's last block boundary
        assert engine.scheduler.state_slots.hits == 2
    assert got == [[want[0]] * 2, [want[2]] * 2]


async def test_disconnects_leave_every_slot_free(model):
    path, _ = model
    async with open_engine(config(path, max_num_seqs=16, max_num_batched_tokens=48)) as engine:
        async def one(i):
            body = {"model": engine.model_names[0], "prompt": PROMPTS[i % 3][:2 + i % 7], "max_tokens": 2 + i % 3,
                    "ignore_eos": True, "stream": True}
            reply = await engine.submit("completions", body)
            if i % 2:               # a client that goes away after its first chunk or two
                async for _ in reply:
                    if i % 4 == 1:
                        break
                await reply.aclose()
            else:
                await reply.read()
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        with trio.fail_after(10):
            while engine.scheduler.has_work() or engine.stats().kv_blocks_used:
                await trio.sleep(0.01)
        slots = engine.scheduler.state_slots
        assert slots.num_used == 0 and sorted(slots.free) == list(range(16))
        assert engine.stats().requests_finished_total.get("abort", 0) > 0


async def test_two_tensor_parallel_ranks_give_the_same_tokens(model):
    """-tp 2 (a worker process over gloo; the heads, conv channels and states split, each
    rank's pool under the scheduler's slot numbers: the step message carries them), chunks
    of 16 tokens, the prompts again as prefix-cache hits (each rank loads its snapshots),
    n = 2: transformers' greedy tokens. (Every family's TP = 2 logits and tokens:
    tests/gpu/test_tp_hybrid.py.)"""
    path, want = model
    threads = torch.get_num_threads()       # rank 0 here takes its share of the cores
    try:
        async with open_engine(config(path, tensor_parallel_size=2, max_num_batched_tokens=16, **CACHED)) as engine:
            first = await generate(engine, PROMPTS)
            again = await generate(engine, PROMPTS[:1], n=2)
            assert engine.scheduler.state_slots.hits >= 2
    finally:
        torch.set_num_threads(threads)
    assert [g[0] for g in first] == want and again == [[want[0]] * 2]


@pytest.mark.parametrize("size,field", [(4, "linear_num_key_heads"), (3, "linear_num_key_heads")])
def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(model, size, field):
    from gpu.loader.decoder import load_shell
    from pipeline.core.kv_layout import check_hybrid

    path, _ = model
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {size} does not divide qwen3_5's {field}"):
        check_hybrid(config(path, tensor_parallel_size=size), load_shell(str(path)).config)


@pytest.mark.parametrize("family,overrides", [("qwen3_next", dict(TINY_EXPERTS, mlp_only_layers=[1])),
                                              ("qwen3_5_moe", {})])
async def test_mixtures_greedy_tokens_equal_transformers(tmp_path, family, overrides):
    """The MoE variants (Qwen3-Next as released, Qwen3.5-MoE), in chunks of 16 tokens."""
    hf = make_hybrid(family, tmp_path, seed=7, **overrides)
    want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    async with open_engine(config(tmp_path, max_num_batched_tokens=16)) as engine:
        got = await generate(engine, PROMPTS)
    assert [g[0] for g in got] == want


async def test_beam_search_is_refused_per_request(model):
    path, _ = model
    async with open_engine(config(path)) as engine:
        reply = await engine.submit("completions", {"model": engine.model_names[0], "prompt": PROMPTS[0],
                                                    "max_tokens": 4, "use_beam_search": True, "n": 2})
        body = await reply.read()
    assert b"use_beam_search: not served for a hybrid model" in body


@pytest.mark.parametrize("flag,kw", [
    ("--speculative-config", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 2}}),
    ("--enable-lora", {"enable_lora": True}),
    ("--kv-transfer-config", {"kv_transfer_config": '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'}),
])
async def test_unsupported_flags_fail_at_start_up(model, flag, kw):
    path, _ = model
    with pytest.raises(ValueError, match=f"{flag} is not supported for qwen3_5, a hybrid"):
        async with open_engine(config(path, **kw)):
            pass
