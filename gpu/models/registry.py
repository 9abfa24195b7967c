"""The model families, by the names checkpoints give them: HF config.json `architectures`
and `model_type`, and GGUF's `general.architecture`. Start-up asks here and nowhere else:
no other module lists architectures (docs/architecture.md, "Adding a model family").

A family is a module of gpu/models/ with two names:
    config_from_hf(d) -> ModelConfig     the family's reading of its config.json dict
    Model                                the torch module class built from that config
Registering one is a line in FAMILIES below.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import attrs

from gpu.config.model import ModelConfig


@attrs.frozen
class Family:
    name: str                           # the module under gpu/models/, and ModelConfig.architecture
    architectures: tuple[str, ...]      # HF config.json "architectures"
    model_types: tuple[str, ...]        # HF config.json "model_type"
    gguf: tuple[str, ...] = ()          # GGUF general.architecture


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), ("llama", "mistral"), ("llama",)),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",)),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)),
    Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",)),
    Family("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",)),
    Family("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), ("qwen3_5_text", "qwen3_5")),
    Family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
           ("qwen3_5_moe_text", "qwen3_5_moe")),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",)),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",)),
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3", "kimi_k2")),
    Family("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4_moe",)),
    Family("llama4", ("Llama4ForCausalLM",), ("llama4_text",)),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), ("phi3",)),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",)),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3", "gemma3_text"), ("gemma3",)),
    Family("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("gemma4", "gemma4_text")),
)


def supported() -> str:
    return ", ".join(f.name for f in FAMILIES)


def family_of(d: dict[str, Any]) -> Family:
    """The family of a config.json dict: its model_type first (a GGUF file's config dict
    carries general.architecture there), else its first known architecture. A GGUF file's
    (gguf_architecture set) matches a family's gguf names only: a family served from HF
    folders whose GGUF layout is not mapped (Gemma 4's `gemma4`) is refused by name."""
    kind = d.get("model_type")
    if (arch := d.get("gguf_architecture")) is not None:
        for f in FAMILIES:
            if arch in f.gguf:
                return f
        raise ValueError(f"unsupported GGUF architecture {arch!r}; GGUF files of: "
                         + ", ".join(g for f in FAMILIES for g in f.gguf))
    for f in FAMILIES:
        if kind is not None and (kind in f.model_types or kind in f.gguf):
            return f
    for arch in d.get("architectures") or ():
        for f in FAMILIES:
            if arch in f.architectures:
                return f
    raise ValueError(f"unsupported architecture {kind or d.get('architectures')!r}; supported: {supported()}")


def module(family: str | Family) -> ModuleType:
    name = family.name if isinstance(family, Family) else family
    if name not in {f.name for f in FAMILIES}:
        raise ValueError(f"unsupported architecture {name!r}; supported: {supported()}")
    return importlib.import_module(f"gpu.models.{name}")


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A config.json dict (or a GGUF file's, gpu/formats/gguf.py config_dict) -> ModelConfig."""
    return module(family_of(d)).config_from_hf(d)


def model_class(config: ModelConfig) -> type:
    """The torch module a config's family builds (CausalLM's signature)."""
    return module(config.architecture).Model
