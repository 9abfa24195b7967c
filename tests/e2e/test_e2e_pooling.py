"""A pooling server over HTTP (issue 32): `tailrace serve` on sentence-transformers'
all-MiniLM-L6-v2 (fp32, CPU), used from the official openai client and plain HTTP, against
sentence-transformers' own `encode` on the same weights."""
from __future__ import annotations

import base64
import concurrent.futures
import json
import random
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest

WORDS = ("the a man woman dog cat eats runs plays music food park city river blue green "
         "quickly slowly under over with without sentence vector search query").split()


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


SENTENCES = _sentences(64)


@pytest.fixture(scope="module")
def pooling_server(serve_with_flags, tmp_path_factory, minilm_dir):
    tmp = tmp_path_factory.mktemp("e2e-pooling")
    yield from serve_with_flags(tmp, str(minilm_dir), "--served-model-name", "minilm",
                                "--event-log", str(tmp / "events.jsonl"))


@pytest.fixture(scope="module")
def client(pooling_server):
    return openai.OpenAI(base_url=pooling_server.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(pooling_server):
    with httpx.Client(base_url=pooling_server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def st_model(minilm_dir):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model):
    return st_model.encode(SENTENCES, batch_size=64)


def _cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embeddings_match_sentence_transformers(client, reference):
    """64 sentences of mixed lengths, one request, the openai client's default (base64)."""
    r = client.embeddings.create(model="minilm", input=SENTENCES)
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(64)) and got.shape == (64, 384)
    assert _cos(got, reference).min() >= 0.99999
    assert r.usage.prompt_tokens == r.usage.total_tokens > 64
    assert r.model == "minilm" and r.object == "list"


def test_float_and_base64_are_the_same_floats(client):
    f = client.embeddings.create(model="minilm", input=SENTENCES[:3], encoding_format="float")
    b = client.embeddings.with_raw_response.create(model="minilm", input=SENTENCES[:3],
                                                   encoding_format="base64")
    raw = json.loads(b.http_response.text)
    for d_f, d_b in zip(f.data, raw["data"]):
        decoded = np.frombuffer(base64.b64decode(d_b["embedding"]), dtype="<f4")
        assert np.array(d_f.embedding, dtype=np.float32).tobytes() == decoded.tobytes()


def test_token_ids_give_the_text_vectors(client, http):
    ids = http.post("/tokenize", json={"prompt": SENTENCES[5]}).json()["tokens"]
    assert ids[0] == 101 and ids[-1] == 102
    text = client.embeddings.create(model="minilm", input=SENTENCES[5], encoding_format="float")
    one = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    many = client.embeddings.create(model="minilm", input=[ids, ids[:5] + [102]], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    np.testing.assert_allclose(many.data[0].embedding, text.data[0].embedding, atol=1e-6)
    assert len(many.data) == 2


def test_rerank_order_and_score_values(http, st_model):
    query = "a man eats food in the park"
    docs = ["a dog runs in the park", "the man eats food", "blue river music", "a woman eats in the city"]
    e = st_model.encode([query] + docs)
    cos = _cos(e[1:], e[0][None, :])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = http.post(path, json={"model": "minilm", "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-cos))
        assert results[0]["document"] == {"text": docs[int(np.argmax(cos))]}
    top = http.post("/rerank", json={"query": query, "documents": docs, "top_n": 2,
                                     "return_documents": False}).json()["results"]
    assert len(top) == 2 and "document" not in top[0]
    s = http.post("/score", json={"model": "minilm", "text_1": query, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in s["data"]], cos, atol=1e-5)
    pairs = http.post("/v1/score", json={"text_1": [query, docs[0]], "text_2": [docs[1], docs[0]]}).json()
    np.testing.assert_allclose(pairs["data"][1]["score"], 1.0, atol=1e-5)


def test_pooling_route_and_invocations(http, client):
    want = client.embeddings.create(model="minilm", input="hello", encoding_format="float").data[0].embedding
    p = http.post("/pooling", json={"input": "hello"}).json()
    assert p["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(p["data"][0]["data"], want, atol=1e-6)
    inv = http.post("/invocations", json={"input": "hello"}).json()
    np.testing.assert_allclose(inv["data"][0]["embedding"], want, atol=1e-6)
    assert http.post("/invocations", json={"query": "q", "documents": ["d"]}).json()["results"]
    # chat-style messages on a pooling model are an embeddings request, as vLLM's: this
    # model has no chat template, so it is the embeddings API's 400, not chat's "pooling model"
    inv = http.post("/invocations", json={"messages": [{"role": "user", "content": "hello"}]})
    assert inv.status_code == 400 and inv.json()["error"]["param"] == "messages", inv.text
    assert "pooling model" not in inv.json()["error"]["message"]
    score = http.post("/invocations", json={"queries": "q", "documents": ["d", "e"]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "word " * 300}, "input"),
    ("/v1/embeddings", {"input": ["fine", "word " * 300]}, "input[1]"),
    ("/v1/embeddings", {"input": "x", "dimensions": 32}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [1, 99999999]}, "input"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}]}, "messages"),   # no template
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/classify", {"input": "x"}, "model"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_truncation(client):
    r = client.embeddings.create(model="minilm", input="word " * 300, encoding_format="float",
                                 extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 256


def test_models_and_metrics(http):
    card = http.get("/v1/models").json()["data"][0]
    assert (card["id"], card["max_model_len"]) == ("minilm", 256)
    metrics = http.get("/metrics").text
    line = next(l for l in metrics.splitlines() if l.startswith("vllm:prompt_tokens_total"))
    assert float(line.rsplit(" ", 1)[1]) > 0
    assert 'vllm:generation_tokens_total{model_name="minilm"} 0.0' in metrics


def test_concurrent_requests_and_a_disconnect(pooling_server, http, client):
    """200 concurrent embedding requests while one client leaves mid-request: every answer
    is right, and nothing stays in flight afterwards."""
    texts = _sentences(200, seed=1)
    want = {t: np.array(d.embedding) for t, d in
            zip(texts[:8], client.embeddings.create(model="minilm", input=texts[:8],
                                                    encoding_format="float").data)}

    def one(i: int):
        with httpx.Client(base_url=pooling_server.url, timeout=300) as c:
            return i, c.post("/v1/embeddings", json={"input": texts[i], "encoding_format": "float"}).json()

    def leaver():
        try:   # a big request whose client gives up at once
            httpx.post(pooling_server.url + "/v1/embeddings", json={"input": _sentences(256, seed=2)},
                       timeout=0.05)
        except httpx.TimeoutException:
            return "left"
        return "answered"

    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        gone = pool.submit(leaver)
        results = list(pool.map(one, range(200)))
    assert gone.result() in ("left", "answered")
    for i, body in results:
        assert len(body["data"][0]["embedding"]) == 384, body
        if texts[i] in want:
            np.testing.assert_allclose(body["data"][0]["embedding"], want[texts[i]], atol=1e-5)
    load = http.get("/load").json()["server_load"]
    metrics = http.get("/metrics").text
    running = next(l for l in metrics.splitlines() if l.startswith("vllm:num_requests_running"))
    assert load == 0 and running.endswith(" 0.0"), (load, running)


def test_replay_reproduces_every_reply(pooling_server, tmp_path):
    """The event log so far (module order: after the other tests) replays byte for byte."""
    events = pooling_server.log.parent / "events.jsonl"
    out = subprocess.run([sys.executable, "-m", "web.cli", "replay", str(events)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 differ" in out.stdout + out.stderr


def test_langchain_openai_embeddings(pooling_server, reference):
    """LangChain's OpenAIEmbeddings, as vLLM documents it (check_embedding_ctx_length=False:
    no tiktoken, the texts are sent as they are)."""
    from langchain_openai import OpenAIEmbeddings
    emb = OpenAIEmbeddings(model="minilm", base_url=pooling_server.base_url, api_key="x",
                           check_embedding_ctx_length=False, max_retries=0)
    got = np.array(emb.embed_documents(SENTENCES[:8]))
    assert _cos(got, reference[:8]).min() >= 0.99999
    assert _cos(np.array(emb.embed_query(SENTENCES[9])), reference[9]) >= 0.99999


def test_cohere_sdk_rerank(pooling_server, st_model):
    """The cohere SDK's rerank: ClientV2 posts to /v2/rerank, Client (v1) to /v1/rerank."""
    import cohere
    query, docs = "a man eats food", ["a dog runs", "the man eats food", "blue river"]
    e = st_model.encode([query] + docs)
    order = list(np.argsort(-_cos(e[1:], e[0][None, :])))
    v2 = cohere.ClientV2(api_key="x", base_url=pooling_server.url).rerank(
        model="minilm", query=query, documents=docs, top_n=2)
    assert [r.index for r in v2.results] == order[:2]
    v1 = cohere.Client(api_key="x", base_url=pooling_server.url).rerank(
        model="minilm", query=query, documents=docs)
    assert [r.index for r in v1.results] == order


def test_bench_serve_embeddings_backend(pooling_server, minilm_dir):
    """`tailrace bench serve --backend openai-embeddings` against the server: every request
    answered, inputs per second reported."""
    host, port = pooling_server.url.removeprefix("http://").rsplit(":", 1)
    out = subprocess.run([sys.executable, "-m", "web.cli", "bench", "serve", "--backend", "openai-embeddings",
                          "--host", host, "--port", port, "--tokenizer", str(minilm_dir),
                          "--random-input-len", "16", "--num-prompts", "32", "--inputs-per-request", "4",
                          "--max-concurrency", "4", "--percentile-metrics", "e2el", "--disable-tqdm"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Successful requests:                     8" in out.stdout
    assert "Embedding inputs per second:" in out.stdout
