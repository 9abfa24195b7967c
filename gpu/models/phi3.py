"""Phi-3 and Phi-4 (`Phi3ForCausalLM`; Phi-4 and Phi-4-mini ship as it): Llama's decoder with
- fused checkpoints: `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up]), split here
  into the parts CausalLM.load_weights stacks back (so tensor-parallel cuts stay per part);
- LongRoPE (`rope_type` longrope, or su/yarn in older configs): short and long per-frequency
  factors and an attention factor (gpu/layers/ops.py build_rope_cache);
- partial rotary (partial_rotary_factor: Phi-4-mini turns 3/4 of each head): RoPE on the
  first rotary_dim dims of each head, HF's pairs (i, i + rotary_dim/2), the rest as they are
  (ModelConfig.rotary_dim, as GLM-4.5's: causal_lm.partial_rope);
- Phi-3-small/medium's sliding_window (every layer) as Mistral's."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gpu.config.model import ModelConfig, hf_fields
from gpu.models.causal_lm import CausalLM


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    partial = float(rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn", "longrope"):
        rope.pop("type", None)
        rope["rope_type"] = "longrope"
        rope.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings", 4096))
    d = {**d, "rope_parameters": rope or None, "rope_scaling": None}
    fields = hf_fields(d, "phi3", max_positions=4096)
    head_dim = fields["head_dim"]
    if partial < 1.0:
        fields["rotary_dim"] = int(head_dim * partial)
    window = d.get("sliding_window")
    if window and window < fields["max_position_embeddings"]:
        fields.update(sliding_window=int(window), layer_types=("sliding_attention",) * fields["num_hidden_layers"])
    return ModelConfig(**fields)


class Phi3(CausalLM):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(named_tensors))

    def _unfused(self, named_tensors):
        c = self.config
        for name, tensor in named_tensors:
            prefix, _, kind = name.rpartition(".")
            parent, _, module = prefix.rpartition(".")
            if module == "qkv_proj":
                parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([c.q_size, c.kv_size, c.kv_size]))
            elif module == "gate_up_proj":
                parts = zip(("gate_proj", "up_proj"), tensor.chunk(2))
            else:
                parts = [(module, tensor)]
            for part, t in parts:
                yield f"{parent}.{part}.{kind}" if parent else name, t


Model = Phi3
