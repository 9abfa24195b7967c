"""The whole engine (eight stages, real SmolLM2 weights) without HTTP."""
from __future__ import annotations

import contextlib

import orjson
import pytest
import torch
import trio

from gpu.layers.attention_dense import DenseCausalAttention
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
import pipeline.core.assembly
import pipeline.core.engine
from pipeline.core.config import EngineConfig
from pipeline.core.engine import open_engine
from pipeline.core.events import read_events
from pipeline.tools.replay import replay
from stages.render import RequestError
from tests.support.smollm_engine import QUESTION, complete, engine_of


async def test_greedy_paris(smollm):
    async with engine_of(smollm) as engine:
        out = await complete(engine, "chat", messages=QUESTION, max_tokens=16)
    assert "Paris" in out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop"


async def test_prefix_cache_hit_same_output(smollm):
    async with engine_of(smollm, enable_prompt_tokens_details=True) as engine:
        first = await complete(engine, "chat", messages=QUESTION, max_tokens=8)
        second = await complete(engine, "chat", messages=QUESTION, max_tokens=8)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    # created_cache_tokens (vLLM's): the prompt's full 16-token blocks it wrote, those it
    # did not find cached: all of them cold, none warm
    full = first["usage"]["prompt_tokens"] // 16 * 16
    assert first["usage"]["prompt_tokens_details"]["created_cache_tokens"] == full > 0
    assert second["usage"]["prompt_tokens_details"]["created_cache_tokens"] == full - cached


async def test_anthropic_usage_counts_the_prompt_tokens_written_to_the_cache(smollm):
    """Anthropic's usage splits the prompt: input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens, as vLLM's. A cold request writes its prompt's full blocks;
    the same prompt again reads them. Without prefix caching nothing is written."""
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "Name three rivers " * 4}]}
    async with engine_of(smollm) as engine:
        cold = (await complete(engine, "messages", **body))["usage"]
        warm = (await complete(engine, "messages", **body))["usage"]
    async with engine_of(smollm, enable_prefix_caching=False) as engine:
        off = (await complete(engine, "messages", **body))["usage"]
    prompt = off["input_tokens"]
    assert off["cache_creation_input_tokens"] == off["cache_read_input_tokens"] == 0
    full = prompt // 16 * 16
    assert (cold["cache_creation_input_tokens"], cold["cache_read_input_tokens"]) == (full, 0)
    assert cold["input_tokens"] == prompt - full
    assert warm["cache_read_input_tokens"] > 0
    assert warm["cache_creation_input_tokens"] == full - warm["cache_read_input_tokens"]
    assert (warm["input_tokens"] + warm["cache_read_input_tokens"]
            + warm["cache_creation_input_tokens"]) == prompt


async def test_chunked_prefill_matches_one_shot(smollm):
    prompt = "The history of the city of Paris begins " * 12     # ~100 tokens
    async with engine_of(smollm, enable_prefix_caching=False) as whole:
        ref = await complete(whole, prompt=prompt, max_tokens=8)
    async with engine_of(smollm, max_num_batched_tokens=24, enable_prefix_caching=False) as chunked:
        got = await complete(chunked, prompt=prompt, max_tokens=8)
        steps = chunked.stats().steps_total
    assert ref["usage"]["prompt_tokens"] > 24
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert steps >= -(-ref["usage"]["prompt_tokens"] // 24) + 7    # prefill took several steps


async def test_preemption_under_tiny_kv_cache_keeps_greedy_outputs(smollm):
    prompts = [f"Count slowly from {i} upwards:" for i in range(6)]

    async def run_all(**cfg) -> tuple[list[str], int]:
        async with engine_of(smollm, **cfg) as engine:
            texts: list[str] = [""] * len(prompts)

            async def one(i: int) -> None:
                out = await complete(engine, prompt=prompts[i], max_tokens=24, ignore_eos=True)
                assert out["usage"]["completion_tokens"] == 24
                texts[i] = out["choices"][0]["text"]

            async with trio.open_nursery() as reqs:
                for i in range(len(prompts)):
                    reqs.start_soon(one, i)
            preemptions = engine.stats().num_preemptions
            assert engine.stats().kv_blocks_used == 0
        return texts, preemptions

    free_texts, _ = await run_all()
    tight_texts, preemptions = await run_all(num_gpu_blocks_override=8, block_size=8,
                                             enable_prefix_caching=False)
    assert preemptions > 0
    assert tight_texts == free_texts


async def test_same_seed_same_output(smollm):
    body = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    async with engine_of(smollm) as engine:
        a = await complete(engine, **body)
        b = await complete(engine, **body)
        c = await complete(engine, **{**body, "seed": 99})
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["text"] != c["choices"][0]["text"]


async def test_stop_string_and_stop_token(smollm):
    async with engine_of(smollm) as engine:
        full = await complete(engine, "chat", messages=QUESTION, max_tokens=16)
        text = full["choices"][0]["message"]["content"]
        cut = await complete(engine, "chat", messages=QUESTION, max_tokens=16, stop=["France"])
    assert cut["choices"][0]["message"]["content"] == text[:text.index("France")]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["stop_reason"] == "France"


async def test_abort_frees_blocks_within_a_step(smollm):
    async with engine_of(smollm) as engine:
        reply = await engine.submit("completions", {"model": engine.model_names[0], "prompt": "Hello",
                                                    "max_tokens": 400, "ignore_eos": True, "stream": True})
        got = 0
        async for _ in reply:
            got += 1
            if got == 3:
                break
        await reply.aclose()
        steps_at_abort = engine.stats().steps_total
        with trio.fail_after(5):
            while engine.stats().kv_blocks_used:
                await trio.sleep(0.001)
        assert engine.stats().steps_total <= steps_at_abort + 1
        with trio.fail_after(5):   # the abort then flows down to account
            while engine.stats().requests_finished_total.get("abort") != 1:
                await trio.sleep(0.001)


async def test_replay_reproduces_every_byte(smollm, tmp_path):
    log = tmp_path / "events.jsonl"
    seen: dict[str, bytes] = {}

    async def raw(api: str, **body) -> None:
        reply = await engine.submit(api, {"model": engine.model_names[0], **body})
        seen[reply.request_id] = await reply.read()

    async with engine_of(smollm, event_log=str(log)) as engine:
        async with trio.open_nursery() as reqs:
            reqs.start_soon(lambda: raw("chat", messages=QUESTION, max_tokens=10, stream=True,
                                        stream_options={"include_usage": True}, stop=["Paris"],
                                        temperature=0))
            reqs.start_soon(lambda: raw("completions", prompt="Once upon a time", max_tokens=10,
                                        temperature=0.8, seed=3, logprobs=2, stream=True))
            reqs.start_soon(lambda: raw("responses", input="Say hi", max_output_tokens=6, stream=True))
    reproduced, logged = replay(log, smollm.tokenizer)
    assert logged == seen                      # the log holds exactly what the clients got
    assert reproduced == logged
    events = list(read_events(log))
    assert events[0]["event"] == "header" and events[0]["stage"] == "engine"
    assert {e["stage"] for e in events[1:]} == {"render", "admit", "schedule", "gpu_step",
                                                "detokenize", "parse", "account", "emit"}
    per_step = {"detokenized", "parsed", "accounted"}   # a step's deltas, each with its id
    assert all(len(r) == 2 for e in events if e["event"] == "emitted" for r in e["replies"])
    assert all("request_id" in e for e in events if e["stage"] in ("render", "admit", "account", "emit")
               and e["event"] not in per_step | {"emitted"})
    assert all("request_id" in d for e in events if e["event"] in per_step for d in e["deltas"])


def test_paged_runner_logits_match_dense(smollm):
    """One prefill split into two chunks, then a decode, against dense attention."""
    from gpu.layers.attention import KVCache
    from gpu.worker.runner import ModelRunner

    model, mc = smollm.model, smollm.config
    ids = smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    cache = KVCache(mc.num_hidden_layers, 8, 4, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, cache, device=torch.device("cpu"))
    captured = []
    orig = model.compute_logits
    model.compute_logits = lambda h: captured.append(orig(h)) or captured[-1]
    try:
        table = (5, 2, 7, 0)                                       # deliberately out of order
        greedy = SamplingOptions(temperature=0.0)
        runner.execute(StepPlan(1, (SeqChunk("s", tuple(ids[:5]), 0, table, False),),
                                (SeqStart("s", tuple(ids), greedy),)))
        r = runner.execute(StepPlan(2, (SeqChunk("s", tuple(ids[5:]), 5, table, True),)))
        nxt = r.token_ids[0]
        runner.execute(StepPlan(3, (SeqChunk("s", (nxt,), len(ids), table, True),)))
    finally:
        model.compute_logits = orig
    with torch.inference_mode():
        full = torch.tensor(ids + [nxt])
        hidden = model(full, torch.arange(len(full)), DenseCausalAttention())
        dense = model.compute_logits(hidden)
    torch.testing.assert_close(captured[0][0], dense[len(ids) - 1], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(captured[1][0], dense[len(ids)], atol=2e-4, rtol=1e-4)


async def test_model_without_tokenizer_serves_token_ids_only(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128, "eos_token_id": 1}))
    async with open_engine(EngineConfig(model=str(tmp_path), load_format="dummy",
                                        max_model_len=64)) as engine:
        out = await complete(engine, prompt=[3, 4, 5], max_tokens=4, ignore_eos=True)
        assert out["usage"] == {**out["usage"], "prompt_tokens": 3, "completion_tokens": 4}
        with pytest.raises(RequestError) as bad_id:
            await engine.submit("completions", {"prompt": [3, 64], "max_tokens": 2})
        with pytest.raises(RequestError) as text:
            await engine.submit("completions", {"prompt": "hello", "max_tokens": 2})
    assert bad_id.value.status == 400 and "vocabulary" in bad_id.value.message
    assert text.value.status == 400 and "tokenizer" in text.value.message


async def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(smollm):
    async with engine_of(smollm) as engine:
        real = engine.runner.execute

        def broken(plan, staged=None):
            if plan.chunks:
                engine.runner.execute = real      # fail once
                raise RuntimeError("device fell over")
            return real(plan, staged)

        engine.runner.execute = broken
        reply = await engine.submit("completions", {"prompt": "Hello", "max_tokens": 4})
        body = orjson.loads(await reply.read())
        assert reply.status == 500 and "device fell over" in body["error"]["message"]
        assert engine.stats().kv_blocks_used == 0
        ok = await complete(engine, prompt="Hello", max_tokens=4, ignore_eos=True)
        assert ok["usage"]["completion_tokens"] == 4


async def test_clients_that_leave_at_once_cannot_overflow_the_scheduler(smollm):
    """Submit-then-disconnect in a tight loop while steps are slow: every such request
    keeps its admission slot until the pipeline has let go of it, so the back-edges into
    schedule's inbox never overflow, and overload is refused with 503."""
    import time as _time

    async with engine_of(smollm, max_num_seqs=1, max_queued_requests=1) as engine:
        real = engine.runner.execute

        def slow(plan, staged=None):
            _time.sleep(0.05)
            return real(plan, staged)

        engine.runner.execute = slow
        main = await engine.submit("chat", {"messages": QUESTION, "max_tokens": 16, "temperature": 0,
                                            "stop": ["Paris"]})
        refused = 0
        for i in range(60):
            try:
                reply = await engine.submit("completions", {"prompt": "Hi", "max_tokens": 50})
            except RequestError as err:
                assert err.status == 503
                refused += 1
                continue
            await reply.aclose()
        body = orjson.loads(await main.read())
        assert body["choices"][0]["finish_reason"] == "stop"
        with trio.fail_after(10):
            while len(engine.replies) or engine.stats().kv_blocks_used:
                await trio.sleep(0.01)
        assert refused > 0


async def test_a_reused_request_id_never_collides(smollm):
    async with engine_of(smollm) as engine:
        first = await engine.submit("completions", {"prompt": "Hello", "max_tokens": 30,
                                                    "ignore_eos": True}, request_id="same")
        await first.aclose()                                  # gone, but still in the pipeline
        second = await engine.submit("completions", {"prompt": "Hello", "max_tokens": 3,
                                                     "ignore_eos": True}, request_id="same")
        assert second.request_id != first.request_id
        assert orjson.loads(await second.read())["usage"]["completion_tokens"] == 3


async def test_logprobs_chat_and_completions(smollm):
    async with engine_of(smollm) as engine:
        chat = await complete(engine, "chat", messages=QUESTION, max_tokens=6, logprobs=True,
                              top_logprobs=3)
        reply = await engine.submit("completions", {"prompt": "Once upon a time", "max_tokens": 5,
                                                    "temperature": 0, "logprobs": 2, "stream": True,
                                                    "ignore_eos": True})
        chunks = [orjson.loads(line[6:]) for line in (await reply.read()).split(b"\n\n")
                  if line.startswith(b"data: {")]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    for entry in content:                                  # greedy: the pick is the top-1
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
        assert sum(2.718281828 ** t["logprob"] for t in entry["top_logprobs"]) <= 1.0001
    assert "".join(e["token"] for e in content).startswith(chat["choices"][0]["message"]["content"][:5])
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    tokens = [t for lp in lps for t in lp["tokens"]]
    assert len(tokens) == 5
    assert all(len(top) == 2 for lp in lps for top in lp["top_logprobs"])
    offsets = [o for lp in lps for o in lp["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0


async def test_a_crashed_stage_stops_the_engine_cleanly(smollm):
    """A stage that raises stops the engine: the request in flight ends with an error
    instead of hanging, new requests get 503, and the stage's error comes out of the
    block once the body is done."""
    with trio.fail_after(30), pytest.raises(BaseExceptionGroup) as info:
        async with engine_of(smollm) as engine:
            def broken():
                raise RuntimeError("scheduler bug")

            engine.scheduler.schedule = broken
            reply = await engine.submit("completions", {"prompt": "Hello", "max_tokens": 4,
                                                        "stream": True})
            body = await reply.read()
            assert reply.status == 500 and body.endswith(b"data: [DONE]\n\n")
            assert b"scheduler bug" in body
            assert not engine.healthy
            with pytest.raises(RequestError) as refused:
                await engine.submit("completions", {"prompt": "Hello", "max_tokens": 4})
            assert refused.value.status == 503
    assert info.group_contains(RuntimeError, match="scheduler bug")


async def test_a_crashed_stage_cancels_a_body_that_does_not_finish(smollm, monkeypatch):
    monkeypatch.setattr(pipeline.core.assembly, "STOP_GRACE_S", 0.2)
    with trio.fail_after(30), pytest.raises(BaseExceptionGroup) as info:
        async with engine_of(smollm) as engine:
            def broken():
                raise RuntimeError("scheduler bug")

            engine.scheduler.schedule = broken
            with contextlib.suppress(RequestError):
                await engine.submit("completions", {"prompt": "Hello", "max_tokens": 4})
            await trio.sleep_forever()
    assert info.group_contains(RuntimeError, match="scheduler bug")


async def test_the_body_error_comes_out_unwrapped_and_the_event_log_is_closed(smollm, tmp_path):
    log = tmp_path / "events.jsonl"
    with pytest.raises(KeyError):
        async with engine_of(smollm, event_log=str(log)) as engine:
            await complete(engine, prompt="Hello", max_tokens=2)
            raise KeyError("from the body")
    assert {e["stage"] for e in read_events(log)} >= {"render", "emit"}   # flushed on close


async def test_async_scheduling_changes_no_byte_of_any_stream(smollm):
    """Planning step N+1 while step N runs (placeholders, dropped rows of finished
    sequences, grammar masks) gives the same streams as planning after each result:
    greedy, seeded n > 1, stop strings, logprobs and a JSON schema, batched together, with
    a KV cache small enough to preempt."""
    import re
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}
    bodies = [
        ("chat", dict(messages=QUESTION, max_tokens=12)),
        ("completions", dict(prompt="Once upon a time", max_tokens=14, temperature=0.9, seed=7,
                             n=2)),
        ("completions", dict(prompt="The capital of France is", max_tokens=16, stop=[" is", "."],
                             logprobs=2)),
        ("chat", dict(messages=QUESTION, max_tokens=20,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": schema}})),
        ("completions", dict(prompt="1, 2, 3,", max_tokens=10, ignore_eos=True)),
    ]

    async def streams(async_scheduling: bool) -> list[bytes]:
        out: list[bytes] = [b""] * len(bodies)
        async with engine_of(smollm, async_scheduling=async_scheduling, num_gpu_blocks_override=12,
                             block_size=8, max_model_len=96) as engine:
            async def one(i, api, body):
                reply = await engine.submit(api, {"model": engine.model_names[0], "temperature": 0,
                                                  "stream": True, **body}, request_id=f"r{i}")
                raw = re.sub(rb'"created":\d+', b'"created":0', await reply.read())
                # logprobs to 4 places: a batch of other rows moves fp32's last digits (the
                # extra rows of finished sequences change the batches, as any timing does)
                out[i] = re.sub(rb"-?\d+\.\d+(?:e-?\d+)?",
                                lambda m: b"%.4f" % float(m.group()), raw)
            async with trio.open_nursery() as n:
                for i, (api, body) in enumerate(bodies):
                    n.start_soon(one, i, api, body)
            preemptions.append(engine.stats().num_preemptions)
        return out

    preemptions: list[int] = []

    def by_choice(stream: bytes) -> dict[int, list[bytes]]:
        """n > 1: each choice's own chunks (how the choices interleave is timing)."""
        out: dict[int, list[bytes]] = {}
        for event in stream.split(b"\n\n"):
            if event.startswith(b"data: {"):
                chunk = orjson.loads(event[6:])
                for c in chunk["choices"]:
                    out.setdefault(c["index"], []).append(orjson.dumps(c))
        return out

    sync, ahead = await streams(False), await streams(True)
    assert all(s.endswith(b"data: [DONE]\n\n") for s in sync)
    assert min(preemptions) > 0, preemptions
    for i, (a, b) in enumerate(zip(sync, ahead)):
        if bodies[i][1].get("n", 1) > 1:
            assert by_choice(a) == by_choice(b) and len(by_choice(a)) == 2, bodies[i]
        else:
            assert a == b, (bodies[i], a[-300:], b[-300:])


async def test_the_loaded_heap_is_frozen_while_the_engine_runs(smollm):
    """open_engine moves what is alive once loaded out of the cyclic collector's sight (no
    full collection walks the model and tokenizer while serving), and gives it back on
    exit."""
    import gc

    assert gc.get_freeze_count() == 0
    async with engine_of(smollm) as engine:
        assert gc.get_freeze_count() > 10_000
        assert (await complete(engine, prompt="Hello", max_tokens=2))["usage"]["completion_tokens"] == 2
    assert gc.get_freeze_count() == 0
