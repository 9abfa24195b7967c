"""Model configuration: one frozen, validated object built from a Hugging Face config.json dict."""

from __future__ import annotations

from typing import Any

import attrs

from gpu.config.moe import MoESpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")

# the MLP activations gpu/layers implements (gated: act(gate) * up); gelu_pytorch_tanh is
# GELU's tanh approximation (Gemma's GeGLU), under every name HF configs give it
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_ACTIVATION_ALIASES = {"gelu_tanh": "gelu_pytorch_tanh", "gelu_new": "gelu_pytorch_tanh",
                       "gelu_fast": "gelu_pytorch_tanh", "swish": "silu"}
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


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
    # Qwen3-Next / Qwen3.5: RoPE on the first head_dim * partial_rotary_factor dims of each
    # head only; a sigmoid output gate on full attention (q_proj gives q and the gate); the
    # "linear_attention" layers' Gated DeltaNet sizes (gpu/layers/linear_attention.py)
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # a mixture's routing, experts, shared expert and dense layers (gpu/config/moe.py); the
    # default is gpt-oss's
    moe: MoESpec = MoESpec()
    # DeepSeek-V2/V3's multi-head latent attention (gpu/layers/mla.py; 0: none): the cached
    # latent's rank, the query's low rank (0: a full q_proj), the per-head non-rotary q/k and v
    # widths; head_dim is then the rotary part's (qk_rope_head_dim), as transformers sets it
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # partial rotary (GLM-4.5, Phi-3/4): RoPE on each head's first rotary_dim dims, HF's
    # rotate-half pairs (i, i + rotary_dim/2) among them, the rest as they are (0: all)
    rotary_dim: int = 0
    rope_interleave: bool = False
    # Llama 4: layers without RoPE (their queries scaled by attn_temperature = (floor_scale,
    # attn_scale): 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))), and a weightless
    # RMSNorm of q and k on the RoPE layers (gpu/models/llama4.py)
    no_rope_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    attn_temperature: tuple[float, float] | None = None
    qk_l2_norm: bool = False   # DeepSeek: the checkpoint's rotary columns as pairs (undone at load)

    hidden_act: str = attrs.field(default="silu", converter=lambda a: _ACTIVATION_ALIASES.get(a, a))
    # Gemma: RMSNorm scales by (1 + w); checkpoints store w, the model holds 1 + w (added
    # as it loads: CausalLM.load_weights), so every norm kernel stays a plain one
    norm_unit_offset: bool = False
    # Gemma 2/3: a norm on the attention's and the MLP's outputs too, before each residual add
    # (the MLP's input norm is then pre_feedforward_layernorm)
    sandwich_norms: bool = False
    embed_scale: float = 1.0    # token embeddings times this (Gemma: sqrt(hidden_size))
    # attention scores scale by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
    query_pre_attn_scalar: float | None = None
    # RoPE base of the sliding-window layers (Gemma 3's local base), plain RoPE; None: rope_theta
    sliding_rope_theta: float | None = None
    # Gemma 2: cap * tanh(x / cap) on the attention scores and on the final logits
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Per-layer-type attention shapes (Gemma 4): the full-attention layers' head_dim and KV
    # heads where they differ from the sliding ones' (0: head_dim, num_key_value_heads); the
    # KV cache then holds each layer in its own shape (gpu/layers/attention.py KVCache)
    full_head_dim: int = 0
    full_kv_heads: int = 0
    # Shared KV (Gemma 4): the last kv_shared_layers layers have no k/v projections and read
    # the cache of the last earlier layer of their type (kv_source); they own no KV memory
    kv_shared_layers: int = 0
    # the attention scores' scale where it is neither head_dim ** -0.5 nor query_pre_attn_scalar's
    attention_scale: float | None = None
    # Gemma 4: the full layers' k projection is their v too (no v_proj; v is k before k_norm
    # and RoPE); a weightless per-head RMSNorm on v
    attention_k_eq_v: bool = False
    v_norm: bool = False
    # Gemma 4's per-layer inputs (gpu/layers/per_layer_inputs.py; 0: none): a second embedding
    # of per_layer_input_size per layer, added to each layer's output through a gated projection
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalars: bool = False        # a loaded scalar multiplies each layer's output
    double_wide_shared_mlp: bool = False   # the shared-KV layers' MLPs are twice as wide
    # Gemma 4 26B-A4B: a routed GeGLU experts branch beside every layer's dense MLP
    # (gpu/layers/parallel_experts.py; 0: none); num_experts stays 0 (no MoE in place of the MLP)
    parallel_experts: int = 0
    parallel_experts_top_k: int = 0
    parallel_expert_intermediate_size: int = 0

    def __attrs_post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
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
        if self.rotary_dim and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in 2..head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
            if self.num_experts % self.moe.n_group:
                raise ValueError(f"n_group {self.moe.n_group} does not divide num_experts {self.num_experts}")
            if self.moe.n_group > 1 and self.num_experts_per_tok > self.moe.topk_group * (
                    self.num_experts // self.moe.n_group):
                raise ValueError("num_experts_per_tok is more than the experts of topk_group groups")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unsupported layer_types {sorted(unknown)}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError("sliding_attention layers need a positive sliding_window")
            if self.num_linear_layers:
                for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim"):
                    if int(getattr(self, name)) <= 0:
                        raise ValueError(f"linear_attention layers need a positive {name}, "
                                         f"got {getattr(self, name)}")
                if self.linear_num_value_heads % self.linear_num_key_heads:
                    raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                                     f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0 < self.partial_rotary_factor <= 1 or self.rope_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even "
                             f"number of rotary dims in 1..head_dim ({self.head_dim})")
        if not 0 <= self.kv_shared_layers < self.num_hidden_layers:
            raise ValueError(f"num_kv_shared_layers must be in 0..{self.num_hidden_layers - 1}, "
                             f"got {self.kv_shared_layers}")
        for i in range(self.num_hidden_layers - self.kv_shared_layers, self.num_hidden_layers):
            self.kv_source(i)   # raises when a shared layer's type has no earlier layer
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def q_scale(self) -> float:
        """What q is multiplied by so that the backends' head_dim ** -0.5 scale gives
        query_pre_attn_scalar ** -0.5, or attention_scale (1.0 without either). One value
        for every layer: the backends' scale is config.head_dim's whatever a layer's own."""
        if self.attention_scale is not None:
            return self.attention_scale * self.head_dim ** 0.5
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    def layer_head_dim(self, layer_idx: int) -> int:
        if self.full_head_dim and self.layer_window(layer_idx) is None:
            return self.full_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer_idx: int) -> int:
        if self.full_kv_heads and self.layer_window(layer_idx) is None:
            return self.full_kv_heads
        return self.num_key_value_heads

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose KV cache this layer attends to: itself, or for one of the last
        kv_shared_layers the last earlier layer of its type (transformers' kv_sharing_modes)."""
        first_shared = self.num_hidden_layers - self.kv_shared_layers
        if layer_idx < first_shared:
            return layer_idx
        kind = self.layer_types[layer_idx] if self.layer_types else "full_attention"
        for j in range(first_shared - 1, -1, -1):
            if (self.layer_types[j] if self.layer_types else "full_attention") == kind:
                return j
        raise ValueError(f"layer {layer_idx} shares the KV of an earlier {kind} layer, and there is none")

    @property
    def kv_layer_shapes(self) -> tuple[tuple[int, int] | None, ...] | None:
        """Per layer (KV heads, head dim) of its cache, None for a layer reading another's
        (kv_source); None when every layer keeps one shape (the cache's plain layout)."""
        if not (self.full_head_dim or self.full_kv_heads or self.kv_shared_layers):
            return None
        return tuple((self.layer_kv_heads(i), self.layer_head_dim(i)) if self.kv_source(i) == i else None
                     for i in range(self.num_hidden_layers))

    def layer_rope_theta(self, layer_idx: int) -> float:
        if self.sliding_rope_theta is not None and self.layer_window(layer_idx) is not None:
            return self.sliding_rope_theta
        return self.rope_theta

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def layer_window(self, layer_idx: int) -> int | None:
        """Keys a query of this layer sees (itself included), or None for full causal attention."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether this layer's MLP is the mixture of experts (else a dense MLP)."""
        return bool(self.num_experts) and layer_idx not in self.moe.dense_layers

    @property
    def dense_intermediate_size(self) -> int:
        """The dense MLP's intermediate size (intermediate_size is per expert in a mixture)."""
        return self.moe.dense_intermediate_size or self.intermediate_size

    @property
    def rope_dim(self) -> int:
        """The leading columns of each head that RoPE rotates (the rest pass through):
        rotary_dim (GLM-4.5), else head_dim * partial_rotary_factor (Qwen3-Next, Qwen3.5)."""
        return self.rotary_dim or int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_cache_head_dim(self) -> int:
        """Values a cached K row holds per KV head: head_dim, or MLA's latent and rotary key."""
        return self.kv_lora_rank + self.head_dim if self.kv_lora_rank else self.head_dim

    @property
    def kv_cache_latent(self) -> int:
        """MLA: the cached latent's width, the V that the K rows' first columns are (0: K and V apart)."""
        return self.kv_lora_rank

    @property
    def num_linear_layers(self) -> int:
        """Gated DeltaNet layers: a state per sequence each, no KV cache."""
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the paged cache (every layer but the linear ones)."""
        return self.num_hidden_layers - self.num_linear_layers

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
        D, L = self.hidden_size, self.num_hidden_layers
        moe = 3 * D * (self.intermediate_size * (self.num_experts_per_tok or 1) + self.moe.shared_intermediate_size)
        moe_layers = sum(self.is_moe_layer(i) for i in range(L)) if self.num_experts else 0
        mlp = moe * moe_layers + 3 * D * self.dense_intermediate_size * (L - moe_layers)
        return L * self.attention_params + mlp + D * self.vocab_size

    @property
    def attention_params(self) -> int:
        """One layer's attention projection weights."""
        D = self.hidden_size
        if not self.kv_lora_rank:
            return D * (2 * self.q_size + 2 * self.kv_size)
        # MLA: q down/up (or q_proj), kv down, kv up, o
        H, qk, r = self.num_attention_heads, self.qk_nope_head_dim + self.head_dim, self.kv_lora_rank
        q = (D + H * qk) * self.q_lora_rank if self.q_lora_rank else D * H * qk
        return q + D * (r + self.head_dim) + r * H * (self.qk_nope_head_dim + self.v_head_dim) + H * self.v_head_dim * D


def hf_fields(d: dict[str, Any], architecture: str, *, max_positions: int = 2048,
              rope_theta: float = 10000.0) -> dict[str, Any]:
    """ModelConfig's fields from the keys every decoder family's config.json shares
    (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`); a family module
    (gpu/models/) overrides what its family reads differently. max_positions, rope_theta:
    the family's defaults where config.json omits the key."""
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
    theta = rope.pop("rope_theta", None) or d.get("rope_theta") or rope_theta
    rope_scaling = rope or dict(d.get("rope_scaling") or {}) or None
    if rope_scaling is not None:
        rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
        rope_scaling.pop("rope_theta", None)
        scaled_by_length = rope_scaling["rope_type"] in ("llama3", "yarn", "longrope")
        if scaled_by_length and "original_max_position_embeddings" not in rope_scaling:
            rope_scaling["original_max_position_embeddings"] = (
                d.get("original_max_position_embeddings") or d["max_position_embeddings"])
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    bias = bool(d.get("attention_bias", False))
    return dict(
        architecture=architecture,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=d.get("max_position_embeddings") or max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bias,
        o_proj_bias=bias,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=d.get("eos_token_id"),
        mrope_section=tuple(mrope) if mrope is not None else None,
        hidden_act=d.get("hidden_act") or d.get("hidden_activation") or "silu",
    )
