"""The LoRA flags (issue 33), with vLLM's names and meaning; EngineConfig holds their values.

`--enable-lora`, `--lora-modules NAME=PATH | JSON ...`, `--max-loras` (distinct adapters in
one step), `--max-lora-rank`, `--max-cpu-loras` (adapters kept loaded, LRU; default
--max-loras), `--lora-dtype` (auto: the model's). Runtime loading is vLLM's environment
variable VLLM_ALLOW_RUNTIME_LORA_UPDATING (web/lora_routes.py).
"""
from __future__ import annotations

import argparse
import os

from gpu.lora.spec import LoRAModule, parse_lora_module

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: 1 or true (any case) turns the endpoints on."""
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


def lora_modules(value) -> tuple[LoRAModule, ...]:
    """EngineConfig's converter: LoRAModule values, `name=path` or JSON strings."""
    out = []
    for item in value or ():
        out.append(item if isinstance(item, LoRAModule) else parse_lora_module(item))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules: the name(s) {', '.join(dup)} appear more than once")
    return tuple(out)


def check_lora(cfg) -> None:
    """The combination rules of the LoRA flags (EngineConfig.__attrs_post_init__)."""
    if cfg.lora_modules and not cfg.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for flag in ("max_loras", "max_lora_rank"):
        if getattr(cfg, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"--max-cpu-loras ({cfg.max_cpu_loras}) must be at least --max-loras "
                         f"({cfg.max_loras})")
    if not cfg.enable_lora:
        return
    for flag, on in (("--simulate-gpu", cfg.simulate_gpu is not None),
                     ("a pooling model (--runner pooling)", cfg.pooling)):
        if on:
            raise ValueError(f"--enable-lora does not combine with {flag} here")


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (docs/cli.md, issue 33)")
    g.add_argument("--enable-lora", action="store_true",
                   help="Serve LoRA adapters on the base model: a request picks one by its "
                        "`model` field.")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH|JSON",
                   help='Adapters to serve (PEFT folders): name=path, or JSON {"name": ..., '
                        '"path": ..., "base_model_name": ...}.')
    g.add_argument("--max-loras", type=int, default=1, metavar="N",
                   help="Most distinct adapters in one step (default: %(default)s).")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="Largest adapter rank accepted (default: %(default)s).")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="Adapters kept loaded, least recently used evicted (default: --max-loras).")
    g.add_argument("--lora-dtype", default="auto", choices=LORA_DTYPES,
                   help="The adapters' dtype; auto: the model's (default: %(default)s).")
