"""LoRA adapters over HTTP (issue 33): /v1/models' adapter cards, and vLLM's runtime
endpoints POST /v1/load_lora_adapter and /v1/unload_lora_adapter, registered only when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (as vLLM: otherwise they are a 404). The engine
side is pipeline/core/lora_admin.py, imported when called (it needs torch; a frontend
process of --api-server-count has none and refuses runtime updates)."""
from __future__ import annotations

from quart import Response

from pipeline.core.lora_config import runtime_updating
from stages.api.common import RequestError


def adapter_cards(engine, created: int) -> list[dict]:
    registry = getattr(getattr(engine, "render_context", None), "loras", None)
    if registry is None:
        return []
    return [{"id": s.name, "object": "model", "created": created, "owned_by": "tailrace",
             "root": s.ref.path, "parent": s.base_model_name,
             "max_model_len": engine.max_model_len} for s in registry]


def _field(body: object, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if value is not None and not isinstance(value, str):
        raise RequestError(f"'{name}' must be a string.", param=name)
    return value or ""


def register(app, engine, json_body, json_error) -> None:
    """The runtime endpoints, when VLLM_ALLOW_RUNTIME_LORA_UPDATING says so."""
    if not runtime_updating():
        return

    def local():
        if not hasattr(engine, "runner"):
            raise RequestError("Runtime LoRA updates are not supported with --api-server-count "
                               "(each frontend holds its own copy of the adapter list).")

    async def load() -> Response:
        try:
            body = await json_body()
            local()
            from pipeline.core.lora_admin import load_lora_adapter
            text = await load_lora_adapter(engine, _field(body, "lora_name"), _field(body, "lora_path"))
        except RequestError as err:
            return json_error(err)
        return Response(text, status=200, content_type="text/plain")

    async def unload() -> Response:
        try:
            body = await json_body()
            local()
            from pipeline.core.lora_admin import unload_lora_adapter
            text = unload_lora_adapter(engine, _field(body, "lora_name"))
        except RequestError as err:
            return json_error(err)
        return Response(text, status=200, content_type="text/plain")

    app.add_url_rule("/v1/load_lora_adapter", endpoint="load_lora_adapter", view_func=load,
                     methods=["POST"])
    app.add_url_rule("/v1/unload_lora_adapter", endpoint="unload_lora_adapter", view_func=unload,
                     methods=["POST"])
