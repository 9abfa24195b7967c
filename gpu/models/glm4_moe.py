"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases (none on o),
an optional per-head q/k RMSNorm (use_qk_norm), RoPE on each head's first
partial_rotary_factor of its columns (half, by default), and DeepSeek-V3's mixture (sigmoid
scores, e_score_correction_bias, grouped top-k, routed_scaling_factor, shared experts; dense
MLPs in the first first_k_dense_replace layers). The multi-token-prediction layer a checkpoint
carries past num_hidden_layers is skipped (deepseek_v3.Model)."""
from __future__ import annotations

from typing import Any

from gpu.config.model import ModelConfig, hf_fields
from gpu.config.moe import MoESpec, dense_layers_from_hf
from gpu.models.deepseek_v3 import Model  # noqa: F401  (CausalLM, MTP layers skipped)


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    layers = d["num_hidden_layers"]
    fields = hf_fields(d, "glm4_moe", max_positions=131072)
    factor = float((d.get("rope_parameters") or {}).get("partial_rotary_factor")
                   or d.get("partial_rotary_factor") or 0.5)
    rotary = int(fields["head_dim"] * factor)
    if rotary % 2 or not 0 < rotary <= fields["head_dim"]:
        raise ValueError(f"partial_rotary_factor {factor} gives {rotary} rotary columns of head_dim {fields['head_dim']}")
    moe_size = d["moe_intermediate_size"]
    return ModelConfig(**{
        **fields,
        "o_proj_bias": False,
        "qk_norm": bool(d.get("use_qk_norm", False)),
        "rotary_dim": rotary if rotary < fields["head_dim"] else 0,
        "intermediate_size": moe_size,
        "num_experts": d.get("n_routed_experts") or d.get("num_local_experts"),
        "num_experts_per_tok": d.get("num_experts_per_tok") or 8,
        "moe": MoESpec(scoring="sigmoid", norm_topk_prob=bool(d.get("norm_topk_prob", True)), router_bias=False,
                       correction_bias=True, n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
                       routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)), activation="swiglu",
                       expert_bias=False, shared_intermediate_size=moe_size * int(d.get("n_shared_experts") or 0),
                       dense_layers=dense_layers_from_hf(d, layers), dense_intermediate_size=d["intermediate_size"]),
    })
