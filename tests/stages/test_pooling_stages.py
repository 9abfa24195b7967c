"""A pooling request through the stages' cores (issue 32): render tokenizes each input,
PoolingScheduler batches whole sequences to the token budget, the runner pools, account
counts the prompt tokens, emit frames the one body; errors name their field."""
from __future__ import annotations

import time

import numpy as np
import orjson
import pytest

from gpu.loader.pooling import load_pooling_model
from gpu.worker.pooling_runner import PoolingRunner
from stages.account import Accountant
from stages.api.common import RequestError
from stages.emit import Emitter, ReplyEnd
from stages.delta import FinishReason
from stages.messages import Submission
from stages.render import RenderContext, render
from stages.schedule.blocks import BlockManager
from stages.schedule.pooling import PoolingScheduler


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load_pooling_model(minilm_dir)


@pytest.fixture(scope="module")
def ctx(minilm):
    return RenderContext(tokenizer=minilm.tokenizer, served_model_names=("minilm",),
                         max_model_len=minilm.max_model_len, vocab_size=30522, pooling=minilm.spec)


def _sub(api: str, body: dict, rid: str = "r") -> Submission:
    return Submission(rid, api, body, time.monotonic())


def _scheduler(budget: int = 512, max_num_seqs: int = 256) -> PoolingScheduler:
    return PoolingScheduler(BlockManager(1, 16), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=256, eos_token_ids=())


def _run(reqs, runner, sched):
    acct, emit = Accountant(), Emitter()
    for r in reqs:
        sched.add(r)
    out: dict[str, list] = {}
    plans = []
    while sched.has_work():
        plan = sched.schedule()
        plans.append(plan)
        step = sched.update(plan, runner.execute(plan)) if plan.chunks else sched.drain()
        step, _ = acct.process(step)
        for rid, item in emit.process(step):
            out.setdefault(rid, []).append(item)
    return out, plans, acct


def test_embeddings_through_the_cores(ctx, minilm, st_model):
    texts = ["A man is eating food.", "The girl is carrying a baby.", "Hi"]
    reqs = [render(_sub("embeddings", {"input": texts, "model": "minilm"}, "a"), ctx),
            render(_sub("embeddings", {"input": "A monkey is playing drums.", "encoding_format": "base64"}, "b"), ctx)]
    assert reqs[0].num_choices == 3 and reqs[0].pooling.reply.kind == "embeddings"
    out, plans, acct = _run(reqs, PoolingRunner(minilm), _scheduler())
    assert len([p for p in plans if p.chunks]) == 1           # both requests in one step
    body_a, end_a = out["a"]
    assert end_a == ReplyEnd(200)
    a = orjson.loads(body_a)
    got = np.array([d["embedding"] for d in a["data"]], dtype=np.float32)
    ref = st_model.encode(texts)
    assert (got * ref).sum(1).min() >= 0.99999
    assert a["usage"]["prompt_tokens"] == sum(len(minilm.tokenizer.encode(t, add_special_tokens=True))
                                              for t in texts)
    assert acct.prompt_tokens_total == a["usage"]["prompt_tokens"] + reqs[1].num_prompt_tokens
    assert acct.finished_total == {FinishReason.STOP: 2} and acct.generation_tokens_total == 0


@pytest.fixture(scope="module")
def st_model(minilm_dir):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm_dir), device="cpu")


def test_sequences_are_never_split_and_fill_the_budget(ctx, minilm):
    """Budget 40 tokens: whole sequences only, in order, as many as fit each step."""
    texts = ["word " * 12, "word " * 20, "word " * 5, "word " * 30]   # 14, 22, 7, 32 tokens
    req = render(_sub("embeddings", {"input": texts}), ctx)
    assert [len(p) for p in req.prompts] == [14, 22, 7, 32]
    out, plans, _ = _run([req], PoolingRunner(minilm), _scheduler(budget=40))
    steps = [[len(c.token_ids) for c in p.chunks] for p in plans if p.chunks]
    assert steps == [[14, 22], [7, 32]]
    assert all(c.start_pos == 0 and c.block_table == () for p in plans for c in p.chunks)
    assert out["r"][-1] == ReplyEnd(200) and len(orjson.loads(out["r"][0])["data"]) == 4


def test_abort_while_the_step_runs_drops_the_reply(ctx, minilm):
    sched = _scheduler()
    req = render(_sub("embeddings", {"input": ["a", "b"]}), ctx)
    sched.add(req)
    plan = sched.schedule()
    result = PoolingRunner(minilm).execute(plan)
    sched.finish("r", FinishReason.ABORT)
    step = sched.update(plan, result)
    assert [d.finish_reason for d in step.deltas] == [FinishReason.ABORT, FinishReason.ABORT]
    assert not sched.has_work() or not sched.schedule().chunks
    assert sched.by_id == {} and sched.choices == {}


def test_score_and_rerank_bi_encoder(ctx, minilm, st_model):
    docs = ["A man is eating pasta.", "A monkey is playing drums.", "Someone eats a meal."]
    query = "A man is eating food."
    reqs = [render(_sub("score", {"text_1": query, "text_2": docs}, "s"), ctx),
            render(_sub("rerank", {"query": query, "documents": docs, "top_n": 2}, "k"), ctx)]
    out, _, _ = _run(reqs, PoolingRunner(minilm), _scheduler())
    e = st_model.encode([query] + docs)
    cos = e[1:] @ e[0]
    score = orjson.loads(out["s"][0])
    np.testing.assert_allclose([d["score"] for d in score["data"]], cos, atol=1e-5)
    rr = orjson.loads(out["k"][0])
    assert [r["index"] for r in rr["results"]] == list(np.argsort(-cos)[:2])
    assert rr["results"][0]["document"] == {"text": docs[int(np.argmax(cos))]}


@pytest.mark.parametrize("api, body, param", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("completions", {"prompt": "hi"}, "model"),
    ("embeddings", {"input": "word " * 300}, "input"),
    ("embeddings", {"input": ["ok", "word " * 300]}, "input[1]"),
    ("embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("classify", {"input": "x"}, "model"),
    ("embeddings", {"input": "x", "model": "other"}, "model"),
])
def test_errors_name_the_field(ctx, api, body, param):
    with pytest.raises(RequestError) as e:
        render(_sub(api, body), ctx)
    assert e.value.param == param and e.value.status in (400, 404), e.value.message


def test_a_pooling_body_on_a_generating_server_is_a_400(ctx):
    gen = RenderContext(tokenizer=ctx.tokenizer, served_model_names=("smol",), max_model_len=256)
    with pytest.raises(RequestError) as e:
        render(_sub("embeddings", {"input": "x"}), gen)
    assert (e.value.status, e.value.param) == (400, "model") and "/v1/embeddings" in e.value.message


def test_truncate_prompt_tokens(ctx):
    req = render(_sub("embeddings", {"input": "word " * 300, "truncate_prompt_tokens": -1}), ctx)
    assert len(req.prompt_token_ids) == 256
    req = render(_sub("embeddings", {"input": "word " * 300, "truncate_prompt_tokens": 10}), ctx)
    assert len(req.prompt_token_ids) == 10 and req.prompt_token_ids[-1] == 102
