"""Llama / Qwen2 / Qwen3 / gpt-oss decoder over flat token batches.

Sequences are concatenated along T (no batch dimension); the attention backend passed to
`forward` knows where each sequence starts and owns the KV cache. q/k/v and gate/up are merged
into single projections at load time (fewer, larger matmuls).

gpt-oss differs in three places: each attention layer has a learned sink logit per head and
(on alternate layers, per config.layer_types) a sliding window, both handed to the attention
backend; the MLP is a mixture of experts (gpu/moe.py); and its expert weights may arrive
MXFP4-quantised (gpu/mxfp4.py): kept packed with packed_experts (the loader's choice on CUDA,
run by gpu/kernels/mxfp4_moe.py), else dequantised while loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from gpu import mxfp4
from gpu.config import ModelConfig
from gpu.moe import MoE
from gpu.ops import apply_rope, build_rope_cache, fused_add_rms_norm, rms_norm, silu_and_mul


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """q [T, Hq, Dh], k/v [T, Hkv, Dh] (normed and roped) -> [T, Hq, Dh].

        sinks [Hq]: a logit per head added to each softmax denominator (its value is zero);
        window: a query at position p sees keys at positions p - window + 1 .. p only."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # [N, D]


class Linear(nn.Linear):
    """nn.Linear that on CPU runs through oneDNN with its weight packed once.

    At decode sizes (tens of rows) the plain matmul re-lays-out the weight on every call;
    oneDNN's packed (blocked) layout is made once, here lazily on the first CPU call and
    again whenever the weight has been written since (weight._version). Measured on
    2 Zen 5 cores, bf16 [32 x 576 x 3072]: 214 against 177 GFLOP/s; the 49k-row
    vocabulary projection: 172 against 120 (scripts/bench_linear.py). The packed copy
    doubles the weights' memory on CPU.
    """

    _packed: torch.Tensor | None = None
    _packed_version: int = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype != w.dtype:  # an fp32 residual stream's normed rows into a bf16 GEMM (CausalLM)
            x = x.to(w.dtype)
        if x.device.type != "cpu" or w.dtype not in _PACKABLE or not _ONEDNN:
            return F.linear(x, w, self.bias)
        version = 0 if w.is_inference() else w._version    # inference tensors keep none
        if self._packed is None or self._packed_version != version:
            with torch.inference_mode():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_version = version
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


_PACKABLE = (torch.float32, torch.bfloat16)
_ONEDNN = torch.backends.mkldnn.is_available()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.split = (c.q_size, c.kv_size, c.kv_size)
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = skip_init(Linear, c.hidden_size, sum(self.split), bias=c.attention_bias, **kw)
        self.o_proj = skip_init(Linear, c.q_size, c.hidden_size, bias=c.o_proj_bias, **kw)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw) if c.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(c.num_attention_heads, **kw)) if c.attention_sinks else None
        self.window = c.layer_window(layer_idx)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) Dh]
        if getattr(attn, "fused_qkv", False):
            # CUDA: q/k norm, rope and the KV-cache write in one kernel (gpu/kernels/qkv_prep.py)
            norms = (None, None, 0.0) if self.q_norm is None else (
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q = attn.write_qkv(self.layer_idx, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                               *norms, positions, cos_sin)
            o = attn.attend(self.layer_idx, q, sinks=self.sinks, window=self.window)  # [T, Hq, Dh]
            return self.o_proj(o.reshape(T, -1))
        q, k, v = qkv.split(self.split, dim=-1)  # [T, Hq*Dh], [T, Hkv*Dh] x2
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, Dh]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)  # per-head norm over Dh
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = apply_rope(q, k, positions, cos_sin)
        o = attn.forward(self.layer_idx, q, k, v, sinks=self.sinks, window=self.window)  # [T, Hq, Dh]
        return self.o_proj(o.reshape(T, -1))  # [T, D]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_up_proj = skip_init(Linear, config.hidden_size, 2 * config.intermediate_size, **kw)
        self.down_proj = skip_init(Linear, config.intermediate_size, config.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, D]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, packed_experts: bool = False):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, dtype, device)
        self.mlp = (MoE(config, dtype, device, packed=packed_experts) if config.num_experts
                    else MLP(config, dtype, device))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, x, residual, positions, cos_sin, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, residual: the running sum it adds to (None at layer 0)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = norm1(x), x
        else:
            h, residual = fused_add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn(h, positions, cos_sin, attn)
        h, residual = fused_add_rms_norm(h, residual, norm2.weight, norm2.eps)
        if isinstance(self.mlp, MoE):  # its router and grouped GEMMs take the weights' dtype only
            h = h.to(norm2.weight.dtype)
        return self.mlp(h), residual


# HF checkpoint projections that are stored stacked in one of our weights: name -> (ours, shard).
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(nn.Module):
    """Parameters start uninitialised (torch.empty): fill them with load_weights.

    dtype: the weights', GEMM inputs' and KV cache's dtype. residual_dtype (default: dtype):
    the residual stream's, so the norms' too. With bf16 weights and an fp32 residual stream
    (the CPU's default recipe, docs/benchmarks.md) every GEMM still runs in bf16 with fp32
    accumulation (Linear casts its input) and its bf16 output is added into fp32 sums: the
    rounding error no longer accumulates along the 30 layers' residual additions.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 max_positions: int | None = None, packed_experts: bool = False,
                 residual_dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        # MXFP4 experts kept as the checkpoint stores them (gpu/moe.py PackedExperts)
        self.packed_experts = packed_experts and bool(config.num_experts)
        self.residual_dtype = residual_dtype or dtype
        c = config
        # _weight: no init at all (skip_init still runs Embedding's normal_ on the meta device,
        # seconds for a 201k-token vocabulary)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, device, self.packed_experts)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = skip_init(Linear, c.hidden_size, c.vocab_size, bias=False, dtype=dtype, device=device)
        # fp32 cos/sin table; a buffer so .to(device) moves it, not persistent so it is never "loaded".
        positions = max_positions or c.max_position_embeddings
        self.register_buffer("cos_sin", build_rope_cache(c, positions, device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids [T], positions [T] -> final normed hidden states [T, D]."""
        x, residual = self.embed_tokens(input_ids).to(self.residual_dtype), None  # [T, D]
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin, attn)
        hidden, _ = fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return hidden  # [T, D]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V]: fp32 on CPU (with bf16 weights under an fp32 residual stream, the top
        logits recomputed in fp32: exact_top_logits); in the model's dtype on CUDA, where the
        device sampler reads bf16 directly and whoever needs fp32 (logprobs, grammar masks)
        converts its rows."""
        logits = self.lm_head(hidden)
        if logits.is_cuda:
            return logits
        logits = logits.float()
        if hidden.dtype == torch.float32 and logits.dtype != self.lm_head.weight.dtype:
            return exact_top_logits(logits, hidden, self.lm_head.weight)
        return logits

    def hf_weight_names(self) -> list[str]:
        """The HF checkpoint names load_weights needs (lm_head.weight only when untied)."""
        names = []
        for name, param in self.named_parameters(remove_duplicate=True):
            prefix, _, kind = name.rpartition(".")  # kind: weight | bias
            module = prefix.rsplit(".", 1)[-1]
            stacked = [hf for hf, (ours, _) in _STACKED.items() if ours == module]
            parents = [prefix.rsplit(".", 1)[0] + "." + hf for hf in stacked] or [prefix]
            names += [_to_hf(p) + "." + kind for p in parents]
        return names

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the merged parameters; raises ValueError on unknown, misshapen
        or missing weights."""
        params = dict(self.named_parameters())
        missing = set(self.hf_weight_names())
        if self.packed_experts:
            named_tensors = _blocks_flattened(named_tensors)
        elif self.config.num_experts:
            named_tensors = mxfp4.dequantize_pairs(_experts_as_ours(named_tensors), self.dtype,
                                                   self.embed_tokens.weight.device)
        for hf_name, tensor in named_tensors:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, rows = self._destination(hf_name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for a {self.config.architecture} model")
            dst = params[target].data[rows]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            missing.discard(_to_hf(hf_name.removeprefix("model.")))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")

    def _destination(self, hf_name: str) -> tuple[str, slice]:
        """Our parameter name for an HF weight, and the rows of it that weight fills."""
        name = hf_name.removeprefix("model.")
        prefix, _, kind = name.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        if module not in _STACKED:
            return name, slice(None)
        merged, shard = _STACKED[module]
        c = self.config
        sizes = [c.q_size, c.kv_size, c.kv_size] if merged == "qkv_proj" else [c.intermediate_size] * 2
        start = sum(sizes[:shard])
        return f"{parent}.{merged}.{kind}", slice(start, start + sizes[shard])


# A bf16 logit is known to half an ulp, 2^-8 of its size: candidates within 2^-6 of the
# row's largest logit are recomputed (four ulps: room for the input's rounding as well).
_TOP_MARGIN = 2.0 ** -6


def exact_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits [N, V] from a bf16 GEMM (rounded to bf16 on output), hidden [N, D] fp32,
    weight [V, D] -> logits whose near-top entries are recomputed in fp32 from the fp32
    hidden state, as a GEMM with an fp32 output would give them. The output rounding
    (up to 0.06 at a logit of 16) decides near-ties; greedy picks and the top
    probabilities then match what an fp32-output kernel (llama.cpp's) gives, for a few
    hundred multiply-adds a row. torch on CPU has no bf16 GEMM with an fp32 output."""
    from gpu.ops import cpu_kernels_or_none   # the same, in one C call (gpu/cpu_kernels.c)
    if (c := cpu_kernels_or_none()) is not None and c.exact_top_logits(logits, hidden, weight, _TOP_MARGIN):
        return logits
    top = logits.amax(-1, keepdim=True)
    rows, cols = (logits >= top - top.abs() * _TOP_MARGIN).nonzero(as_tuple=True)
    logits[rows, cols] = (hidden[rows] * weight[cols].float()).sum(-1)
    return logits


_HF_EXPERT_MATRICES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _experts_as_ours(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """transformers saves unquantised gpt-oss experts as [E, in, out] (x @ W); ours are [E, out, in],
    the layout of the MXFP4 blocks, which pass through untouched."""
    for name, tensor in named_tensors:
        yield name, tensor.transpose(1, 2) if name.endswith(_HF_EXPERT_MATRICES) else tensor


def _blocks_flattened(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """MXFP4 blocks [E, out, in/32, 16] -> [E, out, in/2], the packed experts' layout (a view)."""
    for name, tensor in named_tensors:
        yield name, tensor.flatten(-2) if name.endswith(mxfp4.BLOCKS_SUFFIX) and tensor.dim() == 4 else tensor


def _to_hf(prefix: str) -> str:
    return prefix if prefix.startswith("lm_head") else "model." + prefix
