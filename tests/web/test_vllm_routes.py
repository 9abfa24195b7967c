"""Routes and flags vLLM has (issue 22), over a fake engine: real HTTP on port 0."""
from __future__ import annotations

from test_app import served  # noqa: F401  (the fixture)


async def test_retrieve_a_model_by_id_slashes_included(served):  # noqa: F811
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
