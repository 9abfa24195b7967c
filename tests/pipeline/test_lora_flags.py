"""The LoRA flags (issue 33): vLLM's names and forms, and their combination rules."""
from __future__ import annotations

import argparse
import pickle

import pytest

from gpu.lora.spec import LoRAModule, LoRARegistry, parse_lora_module
from pipeline.core.config import EngineConfig, add_engine_arguments, engine_config


def _args(*argv):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return engine_config(p.parse_args(list(argv)))


def test_flags_with_vllms_names_and_both_module_forms():
    cfg = _args("--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--max-cpu-loras", "5",
                "--lora-dtype", "bfloat16", "--lora-modules", "sql=/a/sql",
                '{"name": "chat", "path": "/a/chat", "base_model_name": "smol"}')
    assert cfg.enable_lora and (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (3, 64, 5)
    assert cfg.lora_dtype == "bfloat16"
    assert cfg.lora_modules == (LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "smol"))
    off = _args()
    assert not off.enable_lora and off.max_loras == 1 and off.max_lora_rank == 16


@pytest.mark.parametrize("kwargs,words", [
    (dict(lora_modules=["a=/x"]), "needs --enable-lora"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "at least --max-loras"),
    (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "more than once"),
    (dict(enable_lora=True, simulate_gpu="h200"), "--simulate-gpu"),
    (dict(enable_lora=True, lora_modules=["nopath"]), "neither name=path"),
    (dict(enable_lora=True, lora_modules=['{"name": "a"}']), "'name' and 'path'"),
])
def test_bad_combinations_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


def test_registry_ids_are_never_reused_and_it_pickles():
    reg = LoRARegistry("base")
    a = reg.add("a", "/a")
    with pytest.raises(KeyError):
        reg.add("a", "/b")
    reg.remove("a")
    again = reg.add("a", "/a")
    assert again.ref.id != a.ref.id and again.base_model_name == "base"
    copy = pickle.loads(pickle.dumps(reg))
    assert [s.ref for s in copy] == [again.ref]
    assert parse_lora_module(" x=/p ").path == "/p"
