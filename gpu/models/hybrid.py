"""The hybrid decoder of Qwen3-Next and Qwen3.5: most layers are Gated DeltaNet linear
attention (gpu/layers/linear_attention.py, a state per sequence in the runner's StatePool),
every `full_attention_interval`-th is gated full attention (gpu/layers/gated_attention.py,
K/V in the paged cache). Norms scale by (1 + w) (gpu/layers/norms.py).

A full-attention layer is the attention backend's layer `kv_index` (its place among the
full layers: the KV cache holds those alone, ModelConfig.num_kv_layers); a linear layer is
the state pool's layer `index` (among the linear ones). The family modules
(gpu/models/qwen3_next.py, qwen3_5.py) choose the linear layers' projection layout.
Single-rank: start-up refuses --tensor-parallel-size > 1 for these models
(pipeline/core/hybrid.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.gated_attention import GatedAttention, partial_rope_cache
from gpu.layers.linear_attention import GatedDeltaNet, state_step_of
from gpu.layers.norms import OffsetRMSNorm, offset_rms_norm
from gpu.layers.ops import skip_init
from gpu.layers.moe import MoE
from gpu.loader.experts import stack_experts
from gpu.models.causal_lm import MLP, CausalLM, Linear, make_moe
from gpu.parallel import SINGLE, TP


class HybridLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kv_index: int, linear_index: int,
                 linear: bool, layout: str, dtype, device):
        super().__init__()
        if linear:
            self.linear_attn = GatedDeltaNet(config, linear_index, layout, dtype, device)
        else:
            self.self_attn = GatedAttention(config, kv_index, dtype, device)
        self.linear = linear
        self.mlp = (make_moe(config, dtype, device, False, SINGLE) if config.is_moe_layer(layer_idx)
                    else MLP(config, dtype, device, intermediate=config.dense_intermediate_size))
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn, step
                ) -> torch.Tensor:
        """x [T, D], the residual stream -> the same after this layer."""
        h = self.input_layernorm(x)
        h = self.linear_attn(h, step) if self.linear else self.self_attn(h, positions, cos_sin, attn)
        x = x + h.to(x.dtype)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):   # its router and grouped GEMMs take the weights' dtype only
            h = h.to(self.mlp.router.weight.dtype)
        return x + self.mlp(h).to(x.dtype)


class HybridLM(nn.Module):
    """CausalLM's constructor and the runner's surface (forward, compute_logits, embed,
    load_weights, local_kv_heads); parameters start uninitialised."""

    linear_layout = "qkvz"      # the family's Gated DeltaNet projections (GatedDeltaNet)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 max_positions: int | None = None, packed_experts: bool = False,
                 residual_dtype: torch.dtype | None = None, tp: TP = SINGLE, lm_head: bool = True):
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{config.architecture}: --tensor-parallel-size > 1 is not supported "
                             "for hybrid linear-attention models yet")
        c = self.config = config
        self.tp = tp
        self.packed_experts = False
        self.residual_dtype = residual_dtype or dtype
        self.vocab_start, self.vocab_real = 0, c.vocab_size
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(
            c.vocab_size, c.hidden_size, dtype=dtype, device=device))
        layers, kv, lin = [], 0, 0
        for i in range(c.num_hidden_layers):
            linear = c.layer_types[i] == "linear_attention"
            layers.append(HybridLayer(c, i, kv, lin, linear, self.linear_layout, dtype, device))
            kv, lin = kv + (not linear), lin + linear
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head: Linear | None = None
        if lm_head and c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight
        elif lm_head:
            self.lm_head = skip_init(Linear, c.hidden_size, c.vocab_size, bias=False, dtype=dtype, device=device)
        self.register_buffer("cos_sin", partial_rope_cache(c, max_positions or c.max_position_embeddings,
                                                           device), persistent=False)
        self.mrope_columns = None
        self.fused_decode = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final normed hidden states [T, D]."""
        x = self.embed(input_ids).to(self.residual_dtype)                # [T, D]
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        if positions.dim() == 2:     # text-only M-RoPE (Qwen3.5): t, h and w positions agree
            positions = positions[0]
        step = state_step_of(attn, x.shape[0])
        for layer in self.layers:
            x = layer(x, positions, self.cos_sin, attn, step)
        return offset_rms_norm(x, self.norm.weight, self.norm.eps)

    embed = CausalLM.embed
    compute_logits = CausalLM.compute_logits

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def local_q_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def local_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    # -- loading -------------------------------------------------------------------------
    def _destination(self, hf_name: str) -> tuple[str, slice] | None:
        """Our parameter and its rows for a checkpoint tensor; None: not ours to load (a
        Qwen3.5 checkpoint's vision tower, the multi-token-prediction head)."""
        name = hf_name.replace("model.language_model.", "model.", 1)
        if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
            return None
        name = name.removeprefix("model.")
        parent, _, leaf = name.rpartition(".")
        parent, _, module = parent.rpartition(".")
        if module in ("gate_proj", "up_proj") and parent.endswith(("mlp", "shared_expert")):
            size = self.get_submodule(parent).down_proj.in_features
            start = 0 if module == "gate_proj" else size
            return f"{parent}.gate_up_proj.{leaf}", slice(start, start + size)
        return name, slice(None)

    def hf_weight_names(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if name.startswith("lm_head"):
                names.append(name)
            elif ".experts." in name or ".router." in name:   # named as stack_experts yields them
                names.append("model." + name)
            elif ".gate_up_proj." in name:
                parent, leaf = name.split(".gate_up_proj.")
                names += [f"model.{parent}.gate_proj.{leaf}", f"model.{parent}.up_proj.{leaf}"]
            else:
                names.append("model." + name)
        return names

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors into our parameters; ValueError on unknown, misshapen or missing ones."""
        params = dict(self.named_parameters())
        missing = set(self.hf_weight_names())
        if self.config.num_experts:     # experts stacked [E, 2I, D] / [E, D, I], the gate as router
            named_tensors = stack_experts(named_tensors, self.config.num_experts)
        for hf_name, tensor in named_tensors:
            if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and (
                    self.config.tie_word_embeddings or self.lm_head is None)):
                continue
            where = self._destination(hf_name)
            if where is None:
                continue
            target, rows = where
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for a {self.config.architecture} model")
            dst = params[target].data[rows]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            missing.discard(hf_name.replace("model.language_model.", "model.", 1))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")
