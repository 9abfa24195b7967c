"""The pooling APIs' protocol (stages/api/pooling.py) and render's half of it
(stages/api/pooling_inputs.py): plans, errors naming their field, reply bodies (issue 32)."""
from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from gpu.config.pooling import PoolingSpec
from gpu.tokenizers.tokenizer import tokenizer_from_hf_dir
from stages.api.common import RequestError, parse_request
from stages.api.pooling import (POOLING_APIS, PoolingInput, PoolingReply, body, plan_embeddings)
from stages.api.pooling_inputs import input_ids

EMBED = PoolingSpec(task="embed", pooling_type="MEAN", normalize=True, use_activation=True, hidden_size=4,
                    encoder=True)
MATRYOSHKA = PoolingSpec(task="embed", pooling_type="LAST", normalize=True, use_activation=True,
                         hidden_size=4, matryoshka=(2, 4))
CROSS = PoolingSpec(task="classify", pooling_type="CLS", normalize=False, use_activation=True, hidden_size=4,
                    num_labels=1, labels=("LABEL_0",), encoder=True)
CLASSES = PoolingSpec(task="classify", pooling_type="CLS", normalize=False, use_activation=True, hidden_size=4,
                      num_labels=2, labels=("neg", "pos"), encoder=True)


def plan(api: str, body_: dict, spec: PoolingSpec = EMBED):
    cls, fn = POOLING_APIS[api]
    return fn(parse_request(body_, cls), spec)


@pytest.mark.parametrize("api, body_, spec, param", [
    ("embeddings", {"input": []}, EMBED, "input"),
    ("embeddings", {"input": ["a", 3]}, EMBED, "input[1]"),
    ("embeddings", {"input": [[1, 2], []]}, EMBED, "input[1]"),
    ("embeddings", {}, EMBED, "input"),
    ("embeddings", {"input": "a", "messages": [{"role": "user", "content": "a"}]}, EMBED, "input"),
    ("embeddings", {"input": "a", "dimensions": 2}, EMBED, "dimensions"),
    ("embeddings", {"input": "a", "dimensions": 3}, MATRYOSHKA, "dimensions"),
    ("embeddings", {"input": "a", "encoding_format": "int8"}, EMBED, "encoding_format"),
    ("embeddings", {"input": "a", "truncate_prompt_tokens": -2}, EMBED, "truncate_prompt_tokens"),
    ("embeddings", {"input": "a"}, CROSS, "model"),
    ("classify", {"input": "a"}, EMBED, "model"),
    ("score", {"text_1": "a"}, EMBED, "text_2"),
    ("score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, EMBED, "text_1"),
    ("score", {"text_1": "a", "text_2": []}, EMBED, "text_2"),
    ("score", {"text_1": "a", "text_2": "b"}, CLASSES, "model"),
    ("rerank", {"query": 1, "documents": ["a"]}, EMBED, "query"),
    ("rerank", {"query": "q", "documents": []}, EMBED, "documents"),
    ("rerank", {"query": "q", "documents": ["a", 2]}, EMBED, "documents[1]"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": -1}, EMBED, "top_n"),
])
def test_bad_input_is_a_400_naming_the_field(api, body_, spec, param):
    with pytest.raises(RequestError) as e:
        plan(api, body_, spec)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_embedding_inputs_of_every_shape():
    assert [i.text for i in plan("embeddings", {"input": "x"}).inputs] == ["x"]
    assert [i.token_ids for i in plan("embeddings", {"input": [5, 6]}).inputs] == [(5, 6)]
    p = plan("embeddings", {"input": [[5], [6, 7]], "truncate_prompt_tokens": 1, "encoding_format": "base64"})
    assert [(i.token_ids, i.param, i.max_tokens) for i in p.inputs] == [((5,), "input[0]", 1), ((6, 7), "input[1]", 1)]
    assert p.reply.encoding_format == "base64"
    p = plan("embeddings", {"input": "x", "dimensions": 2, "normalize": False}, MATRYOSHKA)
    assert (p.options.dimensions, p.options.normalize) == (2, False)
    p = plan("embeddings", {"messages": [{"role": "user", "content": "hi"}]})
    assert [(m.role, m.content) for m in p.messages] == [("user", "hi")]
    assert p.inputs[0].add_special_tokens is False


def test_score_pairs_bi_encoder_and_cross_encoder():
    p = plan("score", {"text_1": "q", "text_2": ["a", "b"]})
    assert [i.text for i in p.inputs] == ["q", "a", "b"] and p.reply.pairs == ((0, 1), (0, 2))
    p = plan("score", {"text_1": ["q", "r"], "text_2": ["a", "b"]})
    assert p.reply.pairs == ((0, 2), (1, 3)) and p.options.normalize is True
    p = plan("score", {"text_1": "q", "text_2": ["a", "b"]}, CROSS)
    assert [i.pair for i in p.inputs] == [("q", "a"), ("q", "b")] and p.reply.pairs == ((0,), (1,))
    p = plan("rerank", {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}, CROSS)
    assert (p.reply.documents, p.reply.top_n) == (("a", "b"), 1)


def _f32(*v) -> bytes:
    return np.array(v, dtype="<f4").tobytes()


def test_reply_bodies():
    vecs = [_f32(0.6, 0.8), _f32(1.0, 0.0), _f32(0.0, 1.0)]
    kw = dict(request_id="r1", model="m", created=7, prompt_tokens=9)
    out = orjson.loads(body(PoolingReply("embeddings"), vectors=vecs, **kw))
    assert out["id"] == "embd-r1" and out["object"] == "list" and out["model"] == "m"
    assert out["data"][0]["index"] == 0 and out["data"][0]["object"] == "embedding"
    assert out["usage"] == {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    b64 = orjson.loads(body(PoolingReply("embeddings", encoding_format="base64"), vectors=vecs, **kw))
    assert np.frombuffer(base64.b64decode(b64["data"][1]["embedding"]), dtype="<f4").tolist() == [1.0, 0.0]
    # float32 values survive the JSON round trip exactly
    assert np.array(out["data"][0]["embedding"], dtype=np.float32).tobytes() == vecs[0]
    score = orjson.loads(body(PoolingReply("score", pairs=((0, 1), (0, 2))), vectors=vecs, **kw))
    assert [round(d["score"], 6) for d in score["data"]] == [0.6, 0.8]
    rr = orjson.loads(body(PoolingReply("rerank", pairs=((0, 1), (0, 2)), documents=("a", "b"), top_n=1),
                           vectors=vecs, **kw))
    assert rr["results"] == [{"index": 1, "document": {"text": "b"}, "relevance_score": pytest.approx(0.8)}]
    assert rr["usage"] == {"prompt_tokens": 9, "total_tokens": 9}   # vLLM has both
    cl = orjson.loads(body(PoolingReply("classify", labels=("neg", "pos")), vectors=[_f32(0.25, 0.75)], **kw))
    assert cl["data"] == [{"index": 0, "label": "pos", "probs": [0.25, 0.75], "num_classes": 2}]


@pytest.fixture(scope="module")
def minilm_tok(minilm_dir):
    return tokenizer_from_hf_dir(minilm_dir)


def test_input_ids_truncate_as_transformers(minilm_tok, minilm_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    text = "one two three four five six seven eight nine ten"
    ids, seg = input_ids(PoolingInput(text=text, max_tokens=6), minilm_tok, 256, None)
    assert ids == hf(text, truncation=True, max_length=6)["input_ids"] and seg == 0
    ids, _ = input_ids(PoolingInput(text=text), minilm_tok, 256, None)
    assert ids == hf(text)["input_ids"]
    pair = ("how old are you", "one two three four five six seven")
    ids, seg = input_ids(PoolingInput(pair=pair, max_tokens=9), minilm_tok, 256, None)
    want = hf(*pair, truncation=True, max_length=9)
    assert ids == want["input_ids"] and seg == want["token_type_ids"].index(1)
    ids, _ = input_ids(PoolingInput(token_ids=(101, 5, 6, 102), max_tokens=3), minilm_tok, 256, None)
    assert ids == [5, 6, 102]          # vLLM keeps the last k of token ids


def test_input_ids_refuse_too_long_and_bad_ids(minilm_tok):
    with pytest.raises(RequestError) as e:
        input_ids(PoolingInput(text="word " * 300, param="input[2]"), minilm_tok, 256, None)
    assert e.value.param == "input[2]" and "256" in e.value.message
    ids, _ = input_ids(PoolingInput(text="word " * 300, max_tokens=-1), minilm_tok, 256, None)
    assert len(ids) == 256 and ids[0] == 101 and ids[-1] == 102
    with pytest.raises(RequestError) as e:
        input_ids(PoolingInput(token_ids=(1, 99999)), minilm_tok, 256, 30522)
    assert e.value.param == "input"
