"""A cross-encoder over HTTP (issue 32): a small random BertForSequenceClassification with
one label (the shape of the ms-marco MiniLM rerankers) on all-MiniLM-L6-v2's tokenizer,
served by `tailrace serve`; /score, /rerank and /classify against sentence-transformers'
CrossEncoder and transformers on the same weights."""
from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import torch

QUERY = "how many people live in berlin"
DOCS = ["Berlin has a population of 3.5 million.", "Paris is the capital of France.",
        "The river flows through the city.", "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, minilm_dir):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=128, num_labels=1)
    model = BertForSequenceClassification(cfg).eval()
    out = tmp_path_factory.mktemp("cross-encoder") / "tiny-reranker"
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def http(serve_with_flags, tmp_path_factory, folder):
    for server in serve_with_flags(tmp_path_factory.mktemp("e2e-cross"), str(folder)):
        with httpx.Client(base_url=server.url, timeout=300) as c:
            yield c


@pytest.fixture(scope="module")
def cross_encoder(folder):
    from sentence_transformers import CrossEncoder
    return CrossEncoder(str(folder), device="cpu")


def test_score_matches_sentence_transformers_cross_encoder(http, cross_encoder):
    want = cross_encoder.predict([(QUERY, d) for d in DOCS])      # sigmoid of the one logit
    r = http.post("/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, atol=1e-5)
    rr = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert [x["index"] for x in rr["results"]] == list(np.argsort(-want))
    raw = http.post("/score", json={"text_1": QUERY, "text_2": DOCS[0], "use_activation": False}).json()
    np.testing.assert_allclose(raw["data"][0]["score"], np.log(want[0] / (1 - want[0])), atol=1e-4)


def test_classify_and_no_embeddings(http, folder):
    from transformers import AutoTokenizer, BertForSequenceClassification
    hf = BertForSequenceClassification.from_pretrained(str(folder)).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    with torch.inference_mode():
        logit = hf(**tok(DOCS[0], return_tensors="pt")).logits[0, 0]
    r = http.post("/classify", json={"input": [DOCS[0]]}).json()
    assert r["data"][0]["num_classes"] == 1 and r["data"][0]["label"] == "LABEL_0"
    np.testing.assert_allclose(r["data"][0]["probs"], [torch.sigmoid(logit).item()], atol=1e-5)
    e = http.post("/v1/embeddings", json={"input": "x"})
    assert e.status_code == 400 and e.json()["error"]["param"] == "model"
