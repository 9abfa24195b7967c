"""The hybrid decoder of Qwen3-Next and Qwen3.5: most layers are Gated DeltaNet linear
attention (gpu/layers/linear_attention.py, a state per sequence in the runner's StatePool),
every `full_attention_interval`-th is gated full attention (gpu/layers/gated_attention.py,
K/V in the paged cache). Norms scale by (1 + w) (gpu/layers/norms.py).

A full-attention layer is the attention backend's layer `kv_index` (its place among the
full layers: the KV cache holds those alone, ModelConfig.num_kv_layers); a linear layer is
the state pool's layer `index` (among the linear ones). The family modules
(gpu/models/qwen3_next.py, qwen3_5.py) choose the linear layers' projection layout.
Tensor parallelism (gpu/parallel.py, CausalLM's contract): the Gated DeltaNet key and value
heads split over the ranks (with them their conv channels, gates and out_proj columns: each
rank's StatePool holds its heads' states, under the scheduler's slot numbers), the gated
attention's query and KV heads as CausalLM's, the MLPs' and experts' intermediate columns
(gpu/layers/moe.py), the vocabulary; each layer's two row-parallel outputs all-reduced.
`shard_pieces` says which rows or columns of a checkpoint tensor a rank keeps.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.gated_attention import GatedAttention, partial_rope_cache
from gpu.layers.linear_attention import GatedDeltaNet, LinearDims, state_step_of
from gpu.layers.norms import OffsetRMSNorm, offset_rms_norm
from gpu.layers.ops import skip_init
from gpu.layers.moe import MoE, expert_columns
from gpu.loader.experts import stack_experts
from gpu.models.causal_lm import ONCE, MLP, CausalLM, Linear, copy_weight, kv_heads, make_moe, q_heads
from gpu.parallel import SINGLE, TP


class HybridLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kv_index: int, linear_index: int,
                 linear: bool, layout: str, dtype, device, tp: TP = SINGLE):
        super().__init__()
        if linear:
            self.linear_attn = GatedDeltaNet(config, linear_index, layout, dtype, device, tp)
        else:
            self.self_attn = GatedAttention(config, kv_index, dtype, device, tp)
        self.linear, self.tp = linear, tp
        self.mlp = (make_moe(config, dtype, device, False, tp) if config.is_moe_layer(layer_idx)
                    else MLP(config, dtype, device, tp, intermediate=config.dense_intermediate_size))
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn, step
                ) -> torch.Tensor:
        """x [T, D], the residual stream -> the same after this layer."""
        h = self.input_layernorm(x)
        h = self.linear_attn(h, step) if self.linear else self.self_attn(h, positions, cos_sin, attn)
        x = x + self.tp.all_reduce(h.to(x.dtype))       # tensor-parallel: the ranks' parts summed
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):   # its router and grouped GEMMs take the weights' dtype only
            h = h.to(self.mlp.router.weight.dtype)
        return x + self.tp.all_reduce(self.mlp(h).to(x.dtype))


class HybridLM(nn.Module):
    """CausalLM's constructor and the runner's surface (forward, compute_logits, embed,
    load_weights, local_kv_heads); parameters start uninitialised."""

    linear_layout = "qkvz"      # the family's Gated DeltaNet projections (GatedDeltaNet)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 max_positions: int | None = None, packed_experts: bool = False,
                 residual_dtype: torch.dtype | None = None, tp: TP = SINGLE, lm_head: bool = True):
        super().__init__()
        c = self.config = config
        self.tp = tp
        self.packed_experts = False
        self.residual_dtype = residual_dtype or dtype
        # vocabulary-parallel as CausalLM: this rank's rows, padded to a multiple of tp.size
        self.vocab_start, vocab_stop = tp.padded_split(c.vocab_size)
        self.vocab_real = max(0, min(vocab_stop, c.vocab_size) - self.vocab_start)
        rows = vocab_stop - self.vocab_start
        table = (torch.zeros if rows != self.vocab_real else torch.empty)(   # padding rows: zero
            rows, c.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(rows, c.hidden_size, _weight=table)
        layers, kv, lin = [], 0, 0
        for i in range(c.num_hidden_layers):
            linear = c.layer_types[i] == "linear_attention"
            layers.append(HybridLayer(c, i, kv, lin, linear, self.linear_layout, dtype, device, tp))
            kv, lin = kv + (not linear), lin + linear
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head: Linear | None = None
        if lm_head and c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, rows, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight
        elif lm_head:
            self.lm_head = skip_init(Linear, c.hidden_size, rows, bias=False, dtype=dtype, device=device)
            if rows != self.vocab_real:     # padding rows: zero (compute_logits masks them)
                with torch.no_grad():
                    self.lm_head.weight.zero_()
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

    def _attention(self) -> GatedAttention:
        return next(layer.self_attn for layer in self.layers if not layer.linear)

    @property
    def local_q_heads(self) -> int:
        return self._attention().num_heads

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and caches: its KV cache's head count."""
        return self._attention().num_kv_heads

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
            tensor = self._sharded(hf_name, tensor)
            if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and (
                    self.config.tie_word_embeddings or self.lm_head is None)):
                continue
            where = self._destination(hf_name)
            if where is None:
                continue
            target, rows = where
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for a {self.config.architecture} model")
            copy_weight(params[target].data[rows], tensor, hf_name, target, self.vocab_real)
            missing.discard(hf_name.replace("model.language_model.", "model.", 1))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")

    def checkpoint_slices(self, hf_name: str, shape: tuple[int, ...]) -> None:
        """Every tensor read whole (load_weights cuts it: qkv and conv1d take three blocks)."""
        return None

    def _sharded(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (the tensor itself at size 1)."""
        if self.tp.size == 1:
            return tensor
        name = hf_name.replace("model.language_model.", "model.", 1).removeprefix("model.")
        spec = shard_pieces(self, name)
        if spec is None:
            return tensor
        if spec == ONCE:
            return tensor if self.tp.first else torch.zeros_like(tensor)
        dim, pieces = spec
        parts = [tensor.narrow(dim, a, b - a) for a, b in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def shard_pieces(model: HybridLM, name: str):
    """How a rank cuts a checkpoint tensor (its name without "model."): (dim, [(start, stop),
    ...] concatenated in order), ONCE (a row-parallel bias rank 0 alone adds) or None
    (replicated: norms, routers, the shared expert's gate)."""
    c, tp = model.config, model.tp
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0, [(model.vocab_start, model.vocab_start + model.vocab_real)]
    if ".linear_attn." in name:
        d, full = LinearDims.of(model.config, tp), LinearDims.of(model.config)
        k0, v0 = tp.rank * d.key_heads, tp.rank * d.value_heads
        kd, vd = d.key_dim, d.value_dim
        qkv = [(k0 * kd, (k0 + d.key_heads) * kd),
               (full.key_heads * kd + k0 * kd, full.key_heads * kd + (k0 + d.key_heads) * kd),
               (2 * full.key_heads * kd + v0 * vd, 2 * full.key_heads * kd + (v0 + d.value_heads) * vd)]
        r = d.value_heads // d.key_heads
        per_head = {"in_proj_qkvz": 2 * kd + 2 * r * vd, "in_proj_ba": 2 * r}
        if leaf in per_head:                  # grouped by key head: one block of rows
            return 0, [(k0 * per_head[leaf], (k0 + d.key_heads) * per_head[leaf])]
        if leaf in ("in_proj_qkv", "conv1d"):  # all q, all k, all v: three blocks
            return 0, qkv
        if leaf == "in_proj_z":
            return 0, [(v0 * vd, (v0 + d.value_heads) * vd)]
        if leaf in ("in_proj_b", "in_proj_a") or name.endswith(("linear_attn.dt_bias", "linear_attn.A_log")):
            return 0, [(v0, v0 + d.value_heads)]
        if leaf == "out_proj":
            return 1, [(v0 * vd, (v0 + d.value_heads) * vd)]
        return None
    if ".self_attn." in name:
        Dh, (q0, q1), (k0, k1) = c.head_dim, q_heads(c, tp), kv_heads(c, tp)
        if leaf == "q_proj":                  # each head's query and gate side by side
            return 0, [(2 * q0 * Dh, 2 * q1 * Dh)]
        if leaf in ("k_proj", "v_proj"):
            return 0, [(k0 * Dh, k1 * Dh)]
        if leaf == "o_proj":
            return ONCE if kind == "bias" else (1, [(q0 * Dh, q1 * Dh)])
        return None
    if leaf in ("gate_proj", "up_proj", "down_proj") and ".experts." not in name:
        I = model.get_submodule(parent).intermediate   # noqa: E741
        i0, i1 = tp.split(I, "intermediate_size")
        return (1 if leaf == "down_proj" else 0), [(i0, i1)]
    if ".experts." in name + ".":
        i0, i1, _ = expert_columns(c, tp, False)
        last = name.rsplit(".", 1)[-1]
        if last.startswith("gate_up_proj"):   # gate and up interleaved by row: pairs stay together
            return 1, [(2 * i0, 2 * i1)]
        if last.startswith("down_proj"):
            return 2, [(i0, i1)]
    return None
