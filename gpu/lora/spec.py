"""LoRA adapters as the request side sees them (issue 33): no torch.

`parse_lora_module` reads one `--lora-modules` item in vLLM's two forms (`name=path`, or
JSON `{"name", "path", "base_model_name"}`). `LoRARegistry` is the served adapters by name:
render resolves a request's `model` through it, /v1/models lists it, and the runtime
load/unload endpoints change it (in one process: the same object the engine holds).
Each adapter gets an id once, when it is registered; the runner keys its loaded weights and
the scheduler its prefix-cache chains by that id (gpu/interface.py LoRARef).
"""
from __future__ import annotations

import json
import threading

import attrs

from gpu.interface import LoRARef


@attrs.frozen
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's forms)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules: {text!r} needs string fields 'name' and 'path'")
        extra = set(obj) - {"name", "path", "base_model_name"}
        if extra:
            raise ValueError(f"--lora-modules: unknown field(s) {sorted(extra)} in {text!r}")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: 'base_model_name' must be a string in {text!r}")
        return LoRAModule(obj["name"], obj["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON object")
    return LoRAModule(name, path)


@attrs.frozen
class ServedLoRA:
    ref: LoRARef
    base_model_name: str       # /v1/models' parent

    @property
    def name(self) -> str:
        return self.ref.name


class LoRARegistry:
    """The adapters served now, by name. Thread-safe (the load endpoint validates an adapter
    in a worker thread). Pickles as a snapshot (a frontend process of --api-server-count
    gets the start-up adapters; runtime updates are refused there)."""

    def __init__(self, base_model_name: str, max_loras: int = 1) -> None:
        self.base_model_name = base_model_name
        self.max_loras = max_loras
        self._by_name: dict[str, ServedLoRA] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, name: str, path: str, base_model_name: str | None = None) -> ServedLoRA:
        with self._lock:
            if name in self._by_name:
                raise KeyError(name)
            served = ServedLoRA(LoRARef(name, self._next_id, path),
                                base_model_name or self.base_model_name)
            self._next_id += 1
            self._by_name[name] = served
            return served

    def remove(self, name: str) -> ServedLoRA:
        with self._lock:
            return self._by_name.pop(name)

    def get(self, name: str | None) -> ServedLoRA | None:
        return self._by_name.get(name) if name else None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)
