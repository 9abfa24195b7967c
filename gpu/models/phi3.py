"""Phi-3 and Phi-4 (`Phi3ForCausalLM`; Phi-4 and Phi-4-mini ship as it): Llama's decoder with
- fused checkpoints: `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up]), split here
  into the parts CausalLM.load_weights stacks back (so tensor-parallel cuts stay per part);
- LongRoPE (`rope_type` longrope, or su/yarn in older configs): short and long per-frequency
  factors and an attention factor (gpu/layers/ops.py build_rope_cache);
- partial rotary (partial_rotary_factor: Phi-4-mini turns 3/4 of each head): RoPE pairs
  dims i and i + rotary_dim/2 of the first rotary_dim, where the rope kernels pair i and
  i + head_dim/2. q's and k's head dims are laid out so the turned pairs sit head_dim/2
  apart (the same order for both: q . k is unchanged) and the table turns the rest by 0;
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


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim]: the checkpoint's head dim each of ours holds. HF turns the pairs (i,
    i + r/2) of the first r dims; ours sit at (i, i + head_dim/2); the unturned dims fill the
    rest of each half in order."""
    h, half = rotary_dim // 2, head_dim // 2
    rest = list(range(rotary_dim, head_dim))
    return torch.tensor(list(range(h)) + rest[:half - h] + list(range(h, rotary_dim)) + rest[half - h:])


class Phi3(CausalLM):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(named_tensors))

    def _unfused(self, named_tensors):
        c = self.config
        order = None
        if c.rotary_dim is not None and c.rotary_dim < c.head_dim:
            order = rotary_order(c.head_dim, c.rotary_dim)
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
                if order is not None and part in ("q_proj", "k_proj"):
                    t = t.reshape(-1, c.head_dim, *t.shape[1:])[:, order].reshape(t.shape)
                yield f"{parent}.{part}.{kind}" if parent else name, t


Model = Phi3
