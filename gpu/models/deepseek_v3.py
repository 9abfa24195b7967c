"""DeepSeek-V3 / R1 and Kimi K2 (their checkpoints' architecture): multi-head latent attention
(gpu/layers/mla.py: the KV cache holds the compressed latent) and a mixture of experts routed
by sigmoid scores with a correction bias, grouped top-k and a scaling factor, plus shared
experts (gpu/config/moe.py), with dense MLPs in the first first_k_dense_replace layers. The
multi-token-prediction layers a checkpoint carries past num_hidden_layers are skipped.

DeepSeek stores each head's rotary q/k columns as interleaved pairs (rope_interleave, the
default); they are reordered at load into the halves layout the RoPE kernels use (the same
permutation on q and k leaves q . k unchanged)."""
from __future__ import annotations

import re
from typing import Any

import torch

from gpu.config.model import ModelConfig, hf_fields
from gpu.config.moe import MoESpec, dense_layers_from_hf
from gpu.models.causal_lm import CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    layers = d["num_hidden_layers"]
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
        raise ValueError(f"DeepSeek routing {d.get('scoring_func')!r}/{d.get('topk_method')!r} is not supported "
                         "(sigmoid scores with noaux_tc only: DeepSeek-V3, R1, Kimi K2)")
    experts = d.get("n_routed_experts") or d.get("num_local_experts")
    moe_size = d["moe_intermediate_size"]
    rope = d.get("qk_rope_head_dim", 64)
    return ModelConfig(**{
        **hf_fields({**d, "head_dim": rope}, "deepseek_v3", max_positions=163840),
        "num_key_value_heads": d["num_attention_heads"],
        "intermediate_size": moe_size,
        "num_experts": experts,
        "num_experts_per_tok": d.get("num_experts_per_tok") or 8,
        "kv_lora_rank": d["kv_lora_rank"],
        "q_lora_rank": d.get("q_lora_rank") or 0,
        "qk_nope_head_dim": d.get("qk_nope_head_dim", 128),
        "v_head_dim": d.get("v_head_dim", 128),
        "moe": MoESpec(scoring="sigmoid", norm_topk_prob=bool(d.get("norm_topk_prob", True)), router_bias=False,
                       correction_bias=True, n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
                       routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)), activation="swiglu",
                       expert_bias=False, shared_intermediate_size=moe_size * int(d.get("n_shared_experts") or 0),
                       dense_layers=dense_layers_from_hf(d, layers), dense_intermediate_size=d["intermediate_size"]),
        "rope_interleave": bool(d.get("rope_interleave", True)),
    })


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Model(CausalLM):
    def load_weights(self, named_tensors) -> None:
        super().load_weights(self._deinterleaved(self._without_mtp(named_tensors)))

    def _without_mtp(self, named_tensors):
        for name, tensor in named_tensors:
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < self.config.num_hidden_layers:
                yield name, tensor

    def _deinterleaved(self, named_tensors):
        c = self.config
        if not c.rope_interleave:
            yield from named_tensors
            return
        d = c.head_dim
        perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])   # pairs -> halves
        for name, t in named_tensors:
            if name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight")):
                H = t.shape[0] // (c.qk_nope_head_dim + d)     # this rank's heads where it arrived cut
                t = t.view(H, c.qk_nope_head_dim + d, -1)
                t = torch.cat([t[:, :c.qk_nope_head_dim], t[:, c.qk_nope_head_dim:][:, perm]], dim=1).reshape(
                    H * (c.qk_nope_head_dim + d), -1)
            elif name.endswith("kv_a_proj_with_mqa.weight") or name.endswith("kv_a_proj_with_mqa.bias"):
                r = c.kv_lora_rank
                t = torch.cat([t[:r], t[r:][perm]])
            yield name, t
