"""Routes and flags vLLM has (issue 22), over a fake engine: real HTTP on port 0."""
from __future__ import annotations

import contextlib
from functools import partial

import httpx

from tests.support.fake_engine import FakeEngine
from web import cli
from web.app import AppConfig
from web.server import listen_socket, serve


async def test_retrieve_a_model_by_id_slashes_included(served):
    engine, http = served
    engine.model_names = ("fake-model", "org/fake-model")
    for name in engine.model_names:
        r = await http.get(f"/v1/models/{name}")
        assert r.status_code == 200
        card = r.json()
        assert card["id"] == name and card["object"] == "model" and card["max_model_len"] == 64
    r = await http.get("/v1/models/org/other")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"


class LoadEngine(FakeEngine):
    load = 3

    def tokenizer_info(self) -> dict:
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "T"}


@contextlib.asynccontextmanager
async def serving(nursery, config: AppConfig):
    engine = LoadEngine()
    binds = await nursery.start(partial(serve, engine, listen_socket("127.0.0.1", 0),
                                        app_config=config, log_level="warning"))
    async with httpx.AsyncClient(base_url=binds[0], timeout=10) as http:
        yield engine, http


async def test_invocations_dispatch_on_the_bodys_shape(nursery):
    async with serving(nursery, AppConfig()) as (engine, http):
        # messages: chat, or on a pooling model embeddings (render decides, as for input)
        r = await http.post("/invocations", json={"messages": [], "stream": False})
        assert r.json() == {"api": "invocation_messages", "ok": True}
        r = await http.post("/invocations", json={"prompt": "hi"})
        assert r.json() == {"api": "completions", "ok": True}
        # pooling bodies (issue 32): embeddings or classes by the model, a score, a rerank
        r = await http.post("/invocations", json={"input": "hi"})
        assert r.json() == {"api": "input", "ok": True}
        for left, right in (("text_1", "text_2"), ("queries", "documents"),
                            ("queries", "items"), ("data_1", "data_2")):   # vLLM's forms
            r = await http.post("/invocations", json={left: "a", right: "b"})
            assert r.json() == {"api": "score", "ok": True}
        r = await http.post("/invocations", json={"query": "q", "documents": ["d"]})
        assert r.json() == {"api": "rerank", "ok": True}
        r = await http.post("/invocations", json={"foo": "hi"})
        assert r.status_code == 400 and "/invocations" in r.json()["error"]["message"]
    nursery.cancel_scope.cancel()


async def test_load_and_tokenizer_info(nursery):
    async with serving(nursery, AppConfig()) as (_, http):
        assert (await http.get("/load")).json() == {"server_load": 3}
        assert (await http.get("/tokenizer_info")).status_code == 404   # not asked for
    async with serving(nursery, AppConfig(enable_tokenizer_info_endpoint=True)) as (_, http):
        info = (await http.get("/tokenizer_info")).json()
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    nursery.cancel_scope.cancel()


async def test_root_path_serves_under_the_prefix_too(nursery):
    config = AppConfig(root_path="/llm/", api_keys=("k",))
    async with serving(nursery, config) as (engine, http):
        auth = {"Authorization": "Bearer k"}
        for path in ("/v1/completions", "/llm/v1/completions"):
            r = await http.post(path, json={"prompt": "x"}, headers=auth)
            assert r.json() == {"api": "completions", "ok": True}, path
            assert (await http.post(path, json={"prompt": "x"})).status_code == 401
        assert (await http.get("/llm/health")).status_code == 200    # open, like /health
        assert (await http.get("/llm/v1/models", headers=auth)).json()["data"]
        assert (await http.get("/llmx/v1/models", headers=auth)).status_code == 404
    nursery.cancel_scope.cancel()


def test_flags_spelled_with_underscores():
    argv = ["serve", "--max_model_len=64", "--max_num_seqs", "4", "--root_path", "/x",
            "--served-model-name", "a_b"]
    args = cli.build_parser(with_bench=False).parse_args([cli.dashed(a) for a in argv])
    assert (args.max_model_len, args.max_num_seqs, args.root_path) == (64, 4, "/x")
    assert args.served_model_name == ["a_b"]            # values keep their underscores
    assert cli.app_config(args).root_path == "/x"
