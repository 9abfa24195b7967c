"""A routed experts branch beside a layer's dense MLP (Gemma 4's 26B-A4B, `enable_moe_block`),
config-driven (ModelConfig.parallel_experts, parallel_experts_top_k,
parallel_expert_intermediate_size). On the MLP's input residual r, with the dense MLP's output m:

    weights, experts = top-k of softmax(proj(rms(r) * scale * hidden ** -0.5)), renormalised,
                       times per_expert_scale[expert]
    out = post_feedforward_layernorm_1(m)
          + post_feedforward_layernorm_2(sum_k weight_k * expert_k(pre_feedforward_layernorm_2(r)))

Each expert is a GeGLU (gelu_tanh(gate) * up, then down) with no biases. The experts are
gpu/layers/moe.py's `Experts`, here holding gate_up as the checkpoint does ([E, 2I, D], gate
rows then up rows, not moe.py's interleaved pairs: nothing here cuts them for tensor
parallelism), run with its grouped_mm over the expert-sorted rows (`run_dense_experts`) and
ops.py's GeGLU (`gelu_tanh_and_mul`: the Triton kernel on CUDA) between them; the fused Triton
MoE kernel, whose epilogue is SwiGLU's on interleaved pairs, is not used (use_kernel off): on
CUDA torch's grouped GEMM runs.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.moe import Experts, run_dense_experts
from gpu.layers.ops import gelu_tanh_and_mul, rms_norm, skip_init


def add_parallel_experts(layer: nn.Module, config: ModelConfig, dtype, device) -> None:
    """Give `layer` the branch's parameters under transformers' Gemma4TextDecoderLayer names
    (router.proj/scale/per_expert_scale, experts.gate_up_proj/down_proj, the three norms), so
    the checkpoint's names are the layer's own."""
    from gpu.models.causal_lm import RMSNorm   # causal_lm imports the layers

    c, kw = config, dict(dtype=dtype, device=device)
    E, D = c.parallel_experts, c.hidden_size
    layer.router = nn.Module()
    layer.router.proj = skip_init(nn.Linear, D, E, bias=False, **kw)
    layer.router.scale = nn.Parameter(torch.ones(D, **kw))
    layer.router.per_expert_scale = nn.Parameter(torch.ones(E, **kw))
    layer.experts = Experts(E, D, c.parallel_expert_intermediate_size, dtype, device, bias=False)
    layer.experts.use_kernel = False     # the fused kernel's epilogue is SwiGLU's
    layer.experts_top_k = c.parallel_experts_top_k
    layer.post_feedforward_layernorm_1 = RMSNorm(D, c.rms_norm_eps, **kw)
    layer.post_feedforward_layernorm_2 = RMSNorm(D, c.rms_norm_eps, **kw)
    layer.pre_feedforward_layernorm_2 = RMSNorm(D, c.rms_norm_eps, **kw)
    layer.register_buffer("router_ones", torch.ones(D, **kw), persistent=False)


def route(layer: nn.Module, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r [T, D] -> (weights [T, k] fp32, experts [T, k])."""
    router, eps = layer.router, layer.post_feedforward_layernorm_1.eps
    x = rms_norm(r, layer.router_ones.to(r.dtype), eps)
    x = x * router.scale.to(x.dtype) * r.shape[-1] ** -0.5
    probs = router.proj(x.to(router.proj.weight.dtype)).float().softmax(dim=-1)
    top, experts = probs.topk(layer.experts_top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top * router.per_expert_scale.float()[experts], experts


def parallel_experts(layer: nn.Module, r: torch.Tensor, dense_out: torch.Tensor) -> torch.Tensor:
    """r [T, D] the MLP's input residual, dense_out [T, D] the dense MLP's output -> their sum
    through the branch's norms (module doc)."""
    T, D = r.shape
    k, ex = layer.experts_top_k, layer.experts
    weights, experts = route(layer, r)
    by_expert, order = experts.flatten().sort(stable=True)                       # (token, slot) -> by expert
    offs = torch.searchsorted(by_expert, torch.arange(1, ex.num_experts + 1, device=r.device), out_int32=True)
    x = layer.pre_feedforward_layernorm_2(r)
    rows = x.index_select(0, order // k).to(ex.gate_up_proj.dtype)
    y = run_dense_experts(ex, rows, offs, by_expert, gelu_tanh_and_mul)          # [N, D]
    y = y * weights.flatten().index_select(0, order).unsqueeze(1).to(y.dtype)
    y = torch.empty_like(y).index_copy_(0, order, y).view(T, k, D).sum(1)
    return layer.post_feedforward_layernorm_1(dense_out) + layer.post_feedforward_layernorm_2(y)
