"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the KV cache holds one compressed
latent a token, not K and V per head.

Per token: c = RMSNorm(x W_kva[:r]) (the latent, r = kv_lora_rank) and k_pe = RoPE(x W_kva[r:])
(the rotary key, d_r = qk_rope_head_dim, shared by every head). Head h's key and value would
be k_h = [c W_uk_h^T, k_pe] and v_h = c W_uv_h^T (W_uk_h [d_n, r], W_uv_h [d_v, r]: kv_b_proj's
rows). Absorbing the up-projections: q_h . k_h = (q_nope_h W_uk_h) . c + q_pe_h . k_pe, and
sum_j p_j v_hj = (sum_j p_j c_j) W_uv_h^T. So attention runs as multi-query attention with one
KV head over the cached rows [c, k_pe] (r + d_r values: 576 for V3), the query [q_nope_h W_uk_h,
q_pe_h] (576 wide) and V the rows' first r columns (the KV cache's V is a view of K's:
gpu/layers/attention.py KVCache(latent=r)); the output [T, H, r] is then multiplied by W_uv_h.
Bytes a token and layer: (r + d_r) x 2 in bf16, 1,152 for V3, against 81,920 for K/V per head
(128 heads x (192 + 128) x 2; docs/kernels.md).

Per step, as vLLM chooses: decode rows (and a short chunk after a cached context, a verify
pass) attend over the latent, absorbed, in one backend call a layer (on CUDA through
gpu/kernels/triton/mla_decode.py); prefill rows expand the latent instead: kv_b_proj
up-projects the context's latent rows (the cached prefix read back from the latent cache, plus
the new chunk) to per-head K [d_n, shared k_pe] and V, and causal SDPA runs at width
d_n + d_r (192 for V3) rather than r + d_r (576), one call per prefill. Per context token the
expansion costs H (d_n + d_v) r MACs, paid once per prefill and not per query row: on a long
prompt the attention's Q x C x H x (d_qk + d_v) dominates, and there the expanded width
(192 + 128) is 0.29x the absorbed (576 + 512).

Tensor parallelism splits the heads (q_b_proj or q_proj and kv_b_proj by rows, o_proj by
columns, then the decoder layer's all-reduce); q_a_proj, kv_a_proj_with_mqa, their norms and
so the latent cache are replicated on every rank, as vLLM does.

The softmax scale is (d_n + d_r)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the
config has it (transformers' yarn_apply_mscale); the query is pre-scaled so that the backend's
own scale gives it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gpu.config.model import ModelConfig
from gpu.layers.attention import sdpa, window_visible
from gpu.layers.ops import apply_rope, rms_norm, skip_init
from gpu.parallel import SINGLE, TP


def softmax_scale(config: ModelConfig) -> float:
    scale = (config.qk_nope_head_dim + config.head_dim) ** -0.5
    s = config.rope_scaling_dict
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        factor = s["factor"]
        m = 1.0 if factor <= 1 else 0.1 * s["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= m * m
    return scale


def latent_shard(c: ModelConfig, tp: TP, leaf: str, kind: str) -> tuple[int, int, int, int] | str | None:
    """gpu/models/causal_lm.py shard_spec for an attention weight: the per-head up-projections
    by rows, o_proj by columns (its bias added once, by rank 0), the rest replicated."""
    h0, h1 = tp.split(c.num_attention_heads, "num_attention_heads")
    per = {"q_proj": c.qk_nope_head_dim + c.head_dim, "q_b_proj": c.qk_nope_head_dim + c.head_dim,
           "kv_b_proj": c.qk_nope_head_dim + c.v_head_dim}.get(leaf)
    if per:
        return 0, h0 * per, h1 * per, c.num_attention_heads * per
    if leaf == "o_proj":
        v = c.v_head_dim
        return "once" if kind == "bias" else (1, h0 * v, h1 * v, c.num_attention_heads * v)
    return None


class LatentAttention(nn.Module):
    """Parameters named as DeepSeek's checkpoints name them (q_a_proj, q_a_layernorm, q_b_proj
    or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    local_rope = False      # one RoPE table for every layer (Gemma 3's sliding layers have their own)

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, tp: TP = SINGLE):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        # tensor-parallel: this rank's heads (q_b_proj and kv_b_proj by rows, o_proj by columns);
        # the latent's down-projection and the cache are replicated, as vLLM does
        h0, h1 = tp.split(c.num_attention_heads, "num_attention_heads")
        self.num_heads, self.num_kv_heads = h1 - h0, 1      # the cache holds one latent
        self.head_dim = c.kv_cache_head_dim
        H, D, r = self.num_heads, c.hidden_size, c.kv_lora_rank
        self.nope, self.rope, self.v_dim, self.rank = c.qk_nope_head_dim, c.head_dim, c.v_head_dim, r
        kw = dict(dtype=dtype, device=device)
        q_out = H * (self.nope + self.rope)
        if c.q_lora_rank:
            self.q_a_proj = skip_init(nn.Linear, D, c.q_lora_rank, bias=c.attention_bias, **kw)
            self.q_a_layernorm = _Norm(c.q_lora_rank, c.rms_norm_eps, **kw)
            self.q_b_proj = skip_init(nn.Linear, c.q_lora_rank, q_out, bias=False, **kw)
        else:
            self.q_proj = skip_init(nn.Linear, D, q_out, bias=False, **kw)
        self.kv_a_proj_with_mqa = skip_init(nn.Linear, D, r + self.rope, bias=c.attention_bias, **kw)
        self.kv_a_layernorm = _Norm(r, c.rms_norm_eps, **kw)
        self.kv_b_proj = skip_init(nn.Linear, r, H * (self.nope + self.v_dim), bias=False, **kw)
        self.o_proj = skip_init(nn.Linear, H * self.v_dim, D, bias=c.attention_bias, **kw)
        self.scale = softmax_scale(c)
        self.sinks, self.window = None, None
        self.expand_prefill = True      # False: prefill rows absorbed too (the tests' other path)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn) -> torch.Tensor:
        T, H, r = x.shape[0], self.num_heads, self.rank
        x = x.to(self.kv_a_proj_with_mqa.weight.dtype)
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)                                           # [T, r + d_r]
        latent = self.kv_a_layernorm(ckv[:, :r])                                   # [T, r]
        q_pe, k_pe = apply_rope(q_pe.contiguous(), ckv[:, None, r:].contiguous(), positions, cos_sin)
        kv = torch.cat([latent, k_pe[:, 0]], dim=-1)[:, None]                      # [T, 1, r + d_r]
        spans = attn.prefill_spans() if self.expand_prefill and hasattr(attn, "prefill_spans") else ()
        if not spans:          # every row decodes: attention over the latent, absorbed
            o = attn.forward(self.layer_idx, self._absorbed_query(q_nope, q_pe, attn), kv, kv[..., :r])
            return self.o_proj(self._absorbed_output(o).reshape(T, H * self.v_dim))
        # decode rows absorbed, prefill rows expanded (as vLLM chooses per step)
        rows = _decode_rows(spans, T, x.device)
        qd = q_nope.new_zeros(T, H, r + self.rope)
        if rows.numel():
            qd.index_copy_(0, rows, self._absorbed_query(q_nope.index_select(0, rows), q_pe.index_select(0, rows), attn))
        o_lat = attn.forward(self.layer_idx, qd, kv, kv[..., :r], prefills=False)  # every row's latent written
        o = q_nope.new_empty(T, H, self.v_dim)
        if rows.numel():
            o.index_copy_(0, rows, self._absorbed_output(o_lat.index_select(0, rows)))
        for s, e, start, seq in spans:
            ctx = kv[s:e, 0] if start == 0 else attn.context(self.layer_idx, seq, q_nope.dtype)[:, 0]
            o[s:e] = self._expanded(q_nope[s:e], q_pe[s:e], ctx, start)
        return self.o_proj(o.reshape(T, H * self.v_dim))

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]                                  # [H, d_n, r], [H, d_v, r]

    def _absorbed_query(self, q_nope, q_pe, attn) -> torch.Tensor:
        """[N, H, r + d_r]: [q_nope_h W_uk_h, q_pe_h], pre-scaled so that the backend's scale
        gives self.scale."""
        backend_scale = getattr(attn, "scale", None) or (self.rank + self.rope) ** -0.5
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self._up()[0])                # [N, H, r]
        return torch.cat([q_lat, q_pe], dim=-1) * (self.scale / backend_scale)

    def _absorbed_output(self, o: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thr,hvr->thv", o, self._up()[1])                      # [N, H, d_v]

    def _expanded(self, q_nope, q_pe, ctx, start: int) -> torch.Tensor:
        """[Q, H, d_v]: one prefill's Q new rows (positions start ..) over its context's latent
        rows ctx [C, r + d_r] (C = start + Q), K and V up-projected per head (kv_b_proj):
        causal attention at width d_n + d_r, not the absorbed r + d_r."""
        Q, H, r, C = q_nope.shape[0], self.num_heads, self.rank, ctx.shape[0]
        kvb = self.kv_b_proj(ctx[:, :r]).view(C, H, self.nope + self.v_dim)        # [C, H, d_n + d_v]
        k = torch.cat([kvb[..., :self.nope], ctx[:, None, r:].expand(C, H, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)                                      # [Q, H, d_n + d_r]
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], kvb[..., self.nope:].transpose(0, 1)[None]
        if start == 0:
            o = sdpa(q, k, v, None, self.scale, is_causal=True)
        else:
            visible = window_visible(torch.arange(start, start + Q, device=q.device),
                                     torch.arange(C, device=q.device), None)
            o = sdpa(q, k, v, visible, self.scale)
        return o[0].transpose(0, 1)


def _decode_rows(spans, T: int, device) -> torch.Tensor | None:
    """[N] int64: the query rows outside every prefill span."""
    keep, at = [], 0
    for s, e, _, _ in spans:
        keep.extend(range(at, s))
        at = e
    keep.extend(range(at, T))
    return torch.tensor(keep, dtype=torch.int64, device=device)

class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def mla_reference(attn: LatentAttention, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Naive causal MLA over one sequence with K and V expanded per head (fp32), as
    transformers computes it: the reference the absorbed path is tested against."""
    T, H, r = x.shape[0], attn.num_heads, attn.rank
    with torch.no_grad():
        x = x.float()
        f = lambda m, t: torch.nn.functional.linear(t, m.weight.float(), None if m.bias is None else m.bias.float())  # noqa: E731
        norm = lambda n, t: rms_norm(t, n.weight.float(), n.eps)  # noqa: E731
        q = f(attn.q_b_proj, norm(attn.q_a_layernorm, f(attn.q_a_proj, x))) if hasattr(attn, "q_b_proj") \
            else f(attn.q_proj, x)
        q_nope, q_pe = q.view(T, H, -1).split([attn.nope, attn.rope], dim=-1)
        ckv = f(attn.kv_a_proj_with_mqa, x)
        latent = norm(attn.kv_a_layernorm, ckv[:, :r])
        pos = torch.arange(T)
        q_pe, k_pe = apply_rope(q_pe.contiguous(), ckv[:, None, r:].contiguous(), pos, cos_sin)
        kv = f(attn.kv_b_proj, latent).view(T, H, attn.nope + attn.v_dim)
        k = torch.cat([kv[..., :attn.nope], k_pe.expand(T, H, attn.rope)], dim=-1)    # [T, H, d_n + d_r]
        v = kv[..., attn.nope:]
        qh = torch.cat([q_nope, q_pe], dim=-1)
        scores = torch.einsum("thd,shd->hts", qh, k) * attn.scale
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hts,shv->thv", scores.softmax(-1), v)
        return f(attn.o_proj, o.reshape(T, -1))
