"""Prompt lists, echo and prompt logprobs through the whole engine (real SmolLM2)."""
from __future__ import annotations

import orjson
import pytest
import torch

from tests.support.smollm_engine import complete, dense_logprobs, engine_of

TEXT = ("The history of the city of Paris begins with a small settlement on an island in "
        "the Seine, where a Celtic people called the Parisii fished and traded for centuries")


def check_against_dense(prompt_logprobs: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = prompt_logprobs[p]
        row = ref[p - 1]
        own = entry[str(ids[p])]
        assert own["logprob"] == pytest.approx(row[ids[p]].item(), abs=2e-3)
        assert own["rank"] == int((row > row[ids[p]]).sum()) + 1
        top_v, top_i = row.topk(k)
        for rank, (i, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), 1):
            if i != ids[p]:
                assert entry[str(i)]["rank"] == rank
                assert entry[str(i)]["logprob"] == pytest.approx(v, abs=2e-3)
        assert len(entry) in (k, k + 1)


async def test_prompt_logprobs_match_a_dense_forward_across_chunks_and_skip_the_cache(smollm):
    ids = smollm.tokenizer.encode(TEXT)
    assert len(ids) > 2 * 16
    ref = dense_logprobs(smollm, ids)
    async with engine_of(smollm, max_num_batched_tokens=8,    # prefill in chunks
                         enable_prompt_tokens_details=True) as engine:
        first = await complete(engine, prompt=ids, max_tokens=2, prompt_logprobs=3)
        again = await complete(engine, prompt=ids, max_tokens=2, prompt_logprobs=3)
        plain = await complete(engine, prompt=ids, max_tokens=2)
    check_against_dense(first["choices"][0]["prompt_logprobs"], ids, ref, 3)
    # a request for prompt logprobs computes every position: no prefix-cache hit...
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    # ... though its blocks were cached for others
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert plain["choices"][0]["prompt_logprobs"] is None     # vLLM's null
    assert first["choices"][0]["text"] == plain["choices"][0]["text"]


async def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(smollm):
    ids = smollm.tokenizer.encode(TEXT)
    ref = dense_logprobs(smollm, ids)
    async with engine_of(smollm) as engine:
        out = await complete(engine, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
        stream = await engine.submit("completions", {"prompt": TEXT, "max_tokens": 0,
                                                     "echo": True, "logprobs": 1,
                                                     "stream": True, "temperature": 0})
        chunks = [orjson.loads(line[6:]) for line in (await stream.read()).split(b"\n\n")
                  if line.startswith(b"data: {")]
    choice = out["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == [smollm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expect = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(expect, abs=2e-3)
    for p in range(1, len(ids)):   # the token itself, then the top 1
        assert list(lp["top_logprobs"][p])[0] == lp["tokens"][p]
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(ref[p - 1].max().item(),
                                                                    abs=2e-3)
    assert lp["text_offset"][0] == 0
    check_against_dense(choice["prompt_logprobs"], ids, ref, 1)
    # streamed: the same echo, in the choice's first chunk
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == TEXT
    streamed = [c["choices"][0]["logprobs"] for c in chunks
                if c["choices"] and c["choices"][0]["logprobs"]]
    assert streamed[0]["token_logprobs"] == lp["token_logprobs"]


async def test_prompt_list_is_several_prompts_indexed_as_vllm(smollm):
    prompts = ["Once upon a time", "The capital of France is"]
    async with engine_of(smollm) as engine:
        alone = [await complete(engine, prompt=p, max_tokens=4, ignore_eos=True)
                 for p in prompts]
        both = await complete(engine, prompt=prompts, n=2, max_tokens=4, ignore_eos=True,
                              echo=True, return_token_ids=False)
    texts = [c["text"] for c in both["choices"]]
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    # prompt i, choice j is choice i * n + j; greedy, so both choices of a prompt agree
    assert texts == [prompts[0] + alone[0]["choices"][0]["text"]] * 2 + \
                    [prompts[1] + alone[1]["choices"][0]["text"]] * 2
    usage = both["usage"]
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == 4 * 4


async def test_replay_reproduces_prompt_lists_echo_and_prompt_logprobs(smollm, tmp_path):
    import trio

    from pipeline.tools.replay import replay

    log = tmp_path / "events.jsonl"
    seen: dict[str, bytes] = {}

    async def raw(api: str, **body) -> None:
        reply = await engine.submit(api, {"model": engine.model_names[0], "temperature": 0,
                                          **body})
        seen[reply.request_id] = await reply.read()

    async with engine_of(smollm, event_log=str(log)) as engine:
        async with trio.open_nursery() as reqs:
            reqs.start_soon(lambda: raw("completions", prompt=["Once upon", "Hello"], n=2,
                                        max_tokens=3, echo=True, logprobs=1, stream=True))
            reqs.start_soon(lambda: raw("completions", prompt=[[1, 2, 3], [4, 5]], max_tokens=0,
                                        echo=True, logprobs=2, prompt_logprobs=2))
            reqs.start_soon(lambda: raw("chat", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=3, prompt_logprobs=1, echo=True))
    reproduced, logged = replay(log, smollm.tokenizer)
    assert logged == seen and reproduced == logged
    assert sum(b'"prompt_logprobs":[null,{' in v for v in seen.values()) == 2


def test_runner_reports_each_prompt_position_once(smollm):
    """Chunks of one prefill report the logprobs of the prompt tokens they score; a
    recompute after preemption reports none again."""
    from gpu.layers.attention import KVCache
    from gpu.interface import SeqChunk, SeqStart, StepPlan
    from gpu.worker.runner import ModelRunner
    from gpu.interface import SamplingOptions

    mc = smollm.config
    ids = smollm.tokenizer.encode(TEXT)[:12]
    cache = KVCache(mc.num_hidden_layers, 8, 4, mc.num_key_value_heads, mc.head_dim,
                    torch.float32, "cpu")
    runner = ModelRunner(smollm.model, cache, device=torch.device("cpu"))
    table = (3, 1, 5)
    start = SeqStart("s", tuple(ids), SamplingOptions(temperature=0.0), prompt_logprobs=2)
    a = runner.execute(StepPlan(1, (SeqChunk("s", tuple(ids[:5]), 0, table, False),), (start,)))
    b = runner.execute(StepPlan(2, (SeqChunk("s", tuple(ids[5:]), 5, table, True),)))
    again = runner.execute(StepPlan(3, (SeqChunk("s", tuple(ids), 0, table, True),)))
    assert [len(p.entries) for p in a.prompt_logprobs] == [5]     # tokens 1..5
    assert [len(p.entries) for p in b.prompt_logprobs] == [6]     # tokens 6..11
    assert again.prompt_logprobs == ()
    ref = dense_logprobs(smollm, ids)
    got = [e.logprob for p in a.prompt_logprobs + b.prompt_logprobs for e in p.entries]
    assert got == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, 12)], abs=2e-3)
