"""Runtime LoRA loading (issue 33): what POST /v1/load_lora_adapter and
/v1/unload_lora_adapter do to a one-process engine (web/lora_routes.py answers them).

Load: the adapter folder is checked in a worker thread (its config against the model and
--max-lora-rank, its tensors' names and shapes, gpu/lora/adapters.py) before its name is served; the
runner loads the weights on the first step that uses it. Unload: the name stops being
served at once (a new request naming it gets the 404 of an unknown model); requests
already admitted with it run to their end on its weights, which the runner drops when the
last of them is released (gpu/lora/adapters.py LoRAManager.forget). A reload under the same name gets
a new id: its sequences share no prefix-cache block and no loaded weights with the old one.
"""
from __future__ import annotations

import torch
import trio

from gpu.lora.adapters import LoRAError, LoRANotFound, load_adapter, read_adapter_config
from stages.api.common import RequestError


async def load_lora_adapter(engine, name: str, path: str) -> str:
    registry = engine.render_context.loras
    if registry is None:
        raise RequestError("LoRA is not enabled: start the server with --enable-lora.")
    if not name or not path:
        raise RequestError("Both 'lora_name' and 'lora_path' must be provided.")
    if name in registry or name in engine.model_names:
        raise RequestError(f"The lora adapter '{name}' has already been loaded.",
                           type="InvalidUserInput")
    cfg = engine.config
    model = engine.loaded.model

    def check():
        adapter_cfg = read_adapter_config(path, engine.loaded.config, cfg.max_lora_rank)
        load_adapter(None, adapter_cfg, model, torch.float32, torch.device("cpu"))
        return adapter_cfg

    try:
        adapter_cfg = await trio.to_thread.run_sync(check)
    except LoRANotFound as exc:
        raise RequestError(str(exc), status=404, type="NotFoundError") from None
    except LoRAError as exc:
        raise RequestError(str(exc), type="BadRequestError") from None
    try:
        registry.add(name, adapter_cfg.path)
    except KeyError:
        raise RequestError(f"The lora adapter '{name}' has already been loaded.",
                           type="InvalidUserInput") from None
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_lora_adapter(engine, name: str) -> str:
    registry = engine.render_context.loras
    if registry is None:
        raise RequestError("LoRA is not enabled: start the server with --enable-lora.")
    if not name:
        raise RequestError("'lora_name' must be provided.")
    try:
        served = registry.remove(name)
    except KeyError:
        raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404,
                           type="NotFoundError") from None
    manager = getattr(engine.runner, "lora", None)
    if manager is not None:
        manager.forget(served.ref.id)
    return f"Success: LoRA adapter '{name}' removed successfully."
