"""Model configuration: one frozen, validated object built from a Hugging Face config.json dict."""

from __future__ import annotations

from typing import Any

import attrs

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# HF defaults where config.json may omit a key (they differ per model family).
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "gpt_oss": 131072}
_DEFAULT_ROPE_THETA = {"gpt_oss": 150000.0}
_ARCH_FROM_CLASS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "GptOssForCausalLM": "gpt_oss"}
# transformers' GptOssConfig default when config.json has no rope parameters.
_GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _freeze_rope_scaling(value: Any) -> tuple[tuple[str, Any], ...] | None:
    """Hashable, order-independent form of a rope scaling dict; None means plain RoPE."""
    if value is None:
        return None
    items = dict(value)
    if items.get("rope_type", "default") == "default":
        return None
    return tuple(sorted(items.items()))


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@attrs.frozen
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # rope_scaling: sorted (key, value) items of the HF dict with "rope_type" set; None for default RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = attrs.field(default=None, converter=_freeze_rope_scaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for qwen2)
    o_proj_bias: bool = False  # llama/qwen3 `attention_bias: true` also puts a bias on o_proj
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_eos_tuple)
    # gpt-oss: a mixture of experts in place of the MLP (num_experts 0 means a dense MLP);
    # intermediate_size is then per expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702  # the experts' clamped SwiGLU: sigmoid gain and clamp
    swiglu_limit: float = 7.0
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax denominator
    sliding_window: int | None = None  # window (keys per query, itself included) of the sliding layers
    # Per layer "full_attention" or "sliding_attention"; empty means every layer is full.
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # Qwen2.5-VL's M-RoPE: how many of the head_dim/2 frequencies take the temporal, height
    # and width position (gpu/layers/ops.py mrope_cos_sin); None: one position a token
    mrope_section: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unsupported layer_types {sorted(unknown)}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError("sliding_attention layers need a positive sliding_window")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def layer_window(self, layer_idx: int) -> int | None:
        """Keys a query of this layer sees (itself included), or None for full causal attention."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def macs_per_token(self) -> int:
        """The multiply-adds of one token's linears: the attention projections, the MLP (a
        mixture's active experts), the LM head. Attention over the context is left out: it
        grows with the context alike for a draft model and its target."""
        mlp = 3 * self.hidden_size * self.intermediate_size * (self.num_experts_per_tok or 1)
        proj = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)
        return self.num_hidden_layers * (proj + mlp) + self.hidden_size * self.vocab_size

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x `rope_theta`/`rope_scaling`
        or 5.x `rope_parameters` layout)."""
        arch = d.get("model_type")
        if arch is None:
            arch = next((_ARCH_FROM_CLASS.get(a) for a in d.get("architectures") or ()), None)
        if arch == "mistral":
            # Mistral is Llama's architecture (the same weights' names) when no sliding
            # window limits its attention (Mistral 7B v0.3 on, Mistral-Nemo, Small)
            if d.get("sliding_window") not in (None, 0) and d["sliding_window"] < d.get(
                    "max_position_embeddings", 0):
                raise ValueError("Mistral with a sliding_window is not supported")
            arch = "llama"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or d.get('architectures')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "gpt_oss":
            d = {"rope_parameters": _GPT_OSS_DEFAULT_ROPE, **d} if not (
                d.get("rope_parameters") or d.get("rope_scaling")) else d
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is supported")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")

        rope = dict(d.get("rope_parameters") or {})
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope.pop("type")
        # Qwen2.5-VL's M-RoPE (transformers 4: rope_scaling {"type": "mrope", ...})
        scaling = dict(d.get("rope_scaling") or {})
        mrope = rope.pop("mrope_section", None) or scaling.pop("mrope_section", None)
        if mrope is not None:
            for r in (rope, scaling):
                if r.get("rope_type", r.get("type")) == "mrope":
                    r.pop("type", None)
                    r["rope_type"] = "default"
            d = {**d, "rope_scaling": scaling or None}
        rope_theta = rope.pop("rope_theta", None) or d.get("rope_theta") or _DEFAULT_ROPE_THETA.get(arch, 10000.0)
        rope_scaling = rope or dict(d.get("rope_scaling") or {}) or None
        if rope_scaling is not None:
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
            rope_scaling.pop("rope_theta", None)
            scaled_by_length = rope_scaling["rope_type"] in ("llama3", "yarn")
            if scaled_by_length and "original_max_position_embeddings" not in rope_scaling:
                rope_scaling["original_max_position_embeddings"] = (
                    d.get("original_max_position_embeddings") or d["max_position_embeddings"])

        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        gpt_oss = arch == "gpt_oss"
        bias = bool(d.get("attention_bias", gpt_oss))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            o_proj_bias=False if arch == "qwen2" else bias,
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=d.get("eos_token_id"),
            mrope_section=tuple(mrope) if mrope is not None else None,
            **(_gpt_oss_fields(d) if gpt_oss else {}),
        )


def _gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types") or [  # transformers' default: sliding on even layers
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return dict(
        num_experts=d.get("num_local_experts") or d.get("num_experts") or 128,
        num_experts_per_tok=d.get("num_experts_per_tok") or d.get("experts_per_token") or 4,
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        attention_sinks=True,
        sliding_window=d.get("sliding_window", 128),
        layer_types=tuple(layer_types),
    )
