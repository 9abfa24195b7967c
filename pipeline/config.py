"""One frozen configuration object, validated at construction.

Field names follow vLLM's flags (``--max-num-seqs`` -> ``max_num_seqs``).
"""
from __future__ import annotations

import attrs


def _positive(inst, attribute, value):
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class EngineConfig:
    model: str | None = None                  # .gguf file or HF directory; None: bundled SmolLM2
    served_model_name: tuple[str, ...] = ()   # empty: the model's own name
    load_format: str = attrs.field(default="auto", validator=attrs.validators.in_(
        ("auto", "gguf", "safetensors", "dummy")))
    dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(
        ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16")))
    device: str = "auto"                      # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    num_gpu_blocks_override: int | None = attrs.field(default=None, validator=_positive)
    kv_cache_memory_bytes: int | None = attrs.field(default=None, validator=_positive)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    max_waiting: int = attrs.field(default=1024, validator=_positive)   # admission queue limit
    reasoning_parser: str | None = None       # None | "qwen3" | "deepseek_r1" (<think> tags)
    event_log: str | None = None              # path for JSON-lines events
    trust_chat_template_kwargs: bool = True
