"""Llama / Qwen2 / Qwen3 / gpt-oss decoder over flat token batches, and the mixtures' (Qwen3-MoE,
Mixtral, DeepSeek-V3, GLM-4.5, Llama 4): the config picks each layer's MLP (a MoE, gpu/layers/moe.py,
or a dense MLP) and attention (gpu/layers/mla.py's latent attention where kv_lora_rank is set).

Sequences are concatenated along T (no batch dimension); the attention backend passed to
`forward` knows where each sequence starts and owns the KV cache. q/k/v and gate/up are merged
into single projections at load time (fewer, larger matmuls).

gpt-oss differs in three places: each attention layer has a learned sink logit per head and
(on alternate layers, per config.layer_types) a sliding window, both handed to the attention
backend; the MLP is a mixture of experts (gpu/layers/moe.py); and its expert weights may arrive
MXFP4-quantised (gpu/quantization/mxfp4.py): kept packed with packed_experts (the loader's choice on CUDA,
run by gpu/kernels/triton/mxfp4_moe.py), else dequantised while loading.

Tensor parallelism (gpu/parallel.py, Megatron's and vLLM's layout): with tp.size > 1 each rank
holds a shard. qkv_proj is column-parallel by heads (q heads split; KV heads split, or, when
there are fewer KV heads than ranks, each rank keeps the one its q heads read); o_proj is
row-parallel, then an all-reduce. gate_up is column-parallel, down row-parallel, then an
all-reduce; the MoE the same along each expert's intermediate dimension. The embedding and
the LM head are vocabulary-parallel (the vocabulary padded to a multiple of tp.size).
Replicated: norms, the router, q/k norms. Row-parallel biases are added once, by rank 0.
load_weights cuts each checkpoint tensor to the rank's rows or columns (shard_spec), and
checkpoint_slices tells a reader which part of a tensor to read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from gpu.quantization import mxfp4
from gpu.config.model import ModelConfig
from gpu.layers.mla import LatentAttention, latent_shard
from gpu.layers.moe import MoE, expert_columns
from gpu.loader.experts import our_name, stack_experts
from gpu.layers.ops import (GATED_ACTIVATIONS, apply_rope, build_rope_cache, fused_add_rms_norm, mrope_columns,
                            mrope_cos_sin, rms_norm, skip_init, softcap)
from gpu.parallel import SINGLE, TP


class AttentionBackend(Protocol):
    # True: the backend takes the raw qkv projection (write_qkv: q/k norm, rope and the
    # KV-cache write in one kernel) and then attend(); False: forward() below, normed and roped
    fused_qkv: bool

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


_ONEDNN = torch.backends.mkldnn.is_available()
# oneDNN packs bf16 weights only on CPUs with bf16 conversions (AVX-512 BW/VL/DQ or
# AVX-NE-CONVERT); elsewhere (an AVX2-only CPU) a bf16 linear is F.linear's
_PACKABLE = (torch.float32, torch.bfloat16) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() \
    else (torch.float32,)


def q_heads(config: ModelConfig, tp: TP) -> tuple[int, int]:
    """This rank's [start, stop) of the query heads."""
    return tp.split(config.num_attention_heads, "num_attention_heads")


def kv_heads(config: ModelConfig, tp: TP) -> tuple[int, int]:
    """This rank's [start, stop) of the KV heads: an even split, or with fewer KV heads than
    ranks the one head this rank's query heads read (replicated over size / Hkv ranks)."""
    hkv = config.num_key_value_heads
    if hkv >= tp.size:
        return tp.split(hkv, "num_key_value_heads")
    if tp.size % hkv:
        raise ValueError(f"num_key_value_heads {hkv} does not divide --tensor-parallel-size {tp.size}")
    head = tp.rank * hkv // tp.size
    return head, head + 1


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, tp: TP = SINGLE):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        (q0, q1), (k0, k1) = q_heads(c, tp), kv_heads(c, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, c.head_dim
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        self.split = (q_size, kv_size, kv_size)
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = skip_init(Linear, c.hidden_size, sum(self.split), bias=c.attention_bias, **kw)
        self.o_proj = skip_init(Linear, q_size, c.hidden_size, bias=c.o_proj_bias, **kw)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw) if c.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads, **kw)) if c.attention_sinks else None
        self.window = c.layer_window(layer_idx)
        self.rope_dim = c.rope_dim
        self.q_scale = c.q_scale     # query_pre_attn_scalar (Gemma) through the backends' head_dim scale
        self.softcap = c.attn_logit_softcapping   # Gemma 2: cap * tanh(score / cap)
        # Gemma 3: the sliding layers' own RoPE base (CausalLM.rope_table gives their table)
        self.local_rope = c.sliding_rope_theta is not None and self.window is not None

    def _attn_kw(self) -> dict:
        kw = dict(sinks=self.sinks, window=self.window)
        if self.softcap:
            kw["softcap"] = self.softcap
        return kw

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) Dh]
        if attn.fused_qkv and self.rope_dim == self.head_dim:
            # CUDA: q/k norm, rope and the KV-cache write in one kernel (gpu/kernels/triton/qkv_prep.py)
            norms = (None, None, 0.0) if self.q_norm is None else (
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q = attn.write_qkv(self.layer_idx, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                               *norms, positions, cos_sin)
            if self.q_scale != 1.0:
                q = q * self.q_scale
            o = attn.attend(self.layer_idx, q, **self._attn_kw())  # [T, Hq, Dh]
            return self.o_proj(o.reshape(T, -1))
        q, k, v = qkv.split(self.split, dim=-1)  # [T, Hq*Dh], [T, Hkv*Dh] x2
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, Dh]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)  # per-head norm over Dh
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = apply_rope(q, k, positions, cos_sin) if self.rope_dim == self.head_dim else \
            partial_rope(q, k, self.rope_dim, positions, cos_sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = attn.forward(self.layer_idx, q, k, v, **self._attn_kw())  # [T, Hq, Dh]
        return self.o_proj(o.reshape(T, -1))  # [T, D]: this rank's heads' part (DecoderLayer sums)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, tp: TP = SINGLE, intermediate: int | None = None):
        """intermediate: the full (unsharded) intermediate size, config.intermediate_size unless given
        (a mixture's dense layers and shared expert)."""
        super().__init__()
        self.intermediate = intermediate or config.intermediate_size
        start, stop = tp.split(self.intermediate, "intermediate_size")
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_up_proj = skip_init(Linear, config.hidden_size, 2 * (stop - start), **kw)
        self.down_proj = skip_init(Linear, stop - start, config.hidden_size, **kw)
        self.act_and_mul = GATED_ACTIVATIONS[config.hidden_act]    # SwiGLU, or GeGLU (Gemma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))  # [T, D]: this rank's part


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, packed_experts: bool = False,
                 tp: TP = SINGLE):
        super().__init__()
        self.tp = tp
        self.self_attn = (LatentAttention if config.kv_lora_rank else Attention)(config, layer_idx, dtype, device, tp)
        self.mlp = (make_moe(config, dtype, device, packed_experts, tp) if config.is_moe_layer(layer_idx)
                    else MLP(config, dtype, device, tp, config.dense_intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # Gemma 2/3 ("sandwich"): post_attention_layernorm normalizes the attention's output,
        # pre_feedforward_layernorm the MLP's input, post_feedforward_layernorm its output
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, x, residual, positions, cos_sin, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, residual: the running sum it adds to (None at layer 0)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = norm1(x), x
        else:
            h, residual = fused_add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self._sum(self.self_attn(h, positions, cos_sin, attn), residual)
        if self.pre_feedforward_layernorm is not None:
            h, norm2 = norm2(h), self.pre_feedforward_layernorm
        h, residual = fused_add_rms_norm(h, residual, norm2.weight, norm2.eps)
        if isinstance(self.mlp, MoE):  # its router and grouped GEMMs take the weights' dtype only
            h = h.to(norm2.weight.dtype)
        out = self._sum(self.mlp(h), residual)
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        return out, residual

    def _sum(self, part: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel: the ranks' row-parallel partial outputs summed, in the residual
        stream's dtype (fp32 under bf16 weights on CPU: each partial is rounded once, as the
        single process rounds its one output, and the sum adds no bf16 rounding of its own)."""
        if self.tp.size == 1:
            return part
        return self.tp.all_reduce(part.to(residual.dtype))


def partial_rope(q, k, dim: int, positions, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on each head's first `dim` columns (GLM-4.5's partial rotary), the rest as they are."""
    qr, kr = apply_rope(q[..., :dim].contiguous(), k[..., :dim].contiguous(), positions, cos_sin)
    return torch.cat([qr, q[..., dim:]], dim=-1), torch.cat([kr, k[..., dim:]], dim=-1)


def make_moe(config: ModelConfig, dtype, device, packed: bool, tp: TP) -> MoE:
    shared = config.moe.shared_intermediate_size
    return MoE(config, dtype, device, packed=packed, tp=tp,
               shared=MLP(config, dtype, device, tp, shared) if shared else None)


# HF checkpoint projections that are stored stacked in one of our weights: name -> (ours, shard).
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def copy_weight(dst: torch.Tensor, tensor: torch.Tensor, hf_name: str, target: str, vocab_real: int) -> None:
    """One checkpoint tensor into its place in a parameter: the vocabulary's real rows (the
    rest is padding, zero), an expert's unpadded part (expert_columns' zero padding stays);
    ValueError on any other shape."""
    if target in ("embed_tokens.weight", "lm_head.weight"):
        dst = dst[:vocab_real]
    elif ".experts." in target and dst.shape != tensor.shape and dst.dim() == tensor.dim():
        for dim, (have, want) in enumerate(zip(tensor.shape, dst.shape)):
            if have < want:
                dst = dst.narrow(dim, 0, have)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(tensor)


class CausalLM(nn.Module):
    """Parameters start uninitialised (torch.empty): fill them with load_weights.

    dtype: the weights', GEMM inputs' and KV cache's dtype. residual_dtype (default: dtype):
    the residual stream's, so the norms' too. With bf16 weights and an fp32 residual stream
    (the CPU's default recipe, docs/benchmarks.md) every GEMM still runs in bf16 with fp32
    accumulation (Linear casts its input) and its bf16 output is added into fp32 sums: the
    rounding error no longer accumulates along the 30 layers' residual additions.
    """

    layer_cls = DecoderLayer     # a family's own block (gpu/layers/), same signature

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 max_positions: int | None = None, packed_experts: bool = False,
                 residual_dtype: torch.dtype | None = None, tp: TP = SINGLE, lm_head: bool = True):
        """lm_head=False: the backbone alone (a pooling model's, gpu/layers/pooler.py): no LM head is
        built, and a checkpoint's lm_head.weight is skipped."""
        super().__init__()
        self.config = config
        self.tp = tp
        # MXFP4 experts kept as the checkpoint stores them (gpu/layers/moe.py PackedExperts)
        self.packed_experts = packed_experts and bool(config.num_experts)
        self.residual_dtype = residual_dtype or dtype
        c = config
        # This rank's rows of the vocabulary, padded to a multiple of tp.size: the padding rows
        # are never looked up and their logits are cut off (compute_logits).
        self.vocab_start, vocab_stop = tp.padded_split(c.vocab_size)
        rows = vocab_stop - self.vocab_start
        self.vocab_real = max(0, min(vocab_stop, c.vocab_size) - self.vocab_start)  # rows that are tokens
        # _weight: no init at all (skip_init still runs Embedding's normal_ on the meta device,
        # seconds for a 201k-token vocabulary)
        self.embed_tokens = nn.Embedding(rows, c.hidden_size,
                                         _weight=torch.empty(rows, c.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(self.layer_cls(c, i, dtype, device, self.packed_experts, tp)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head: Linear | None = None
        if lm_head and c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, rows, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight
        elif lm_head:
            self.lm_head = skip_init(Linear, c.hidden_size, rows, bias=False, dtype=dtype, device=device)
        if rows > self.vocab_real:
            with torch.no_grad():
                self.embed_tokens.weight[self.vocab_real:].zero_()
                if self.lm_head is not None:
                    self.lm_head.weight[self.vocab_real:].zero_()
        # fp32 cos/sin table; a buffer so .to(device) moves it, not persistent so it is never "loaded".
        positions = max_positions or c.max_position_embeddings
        self.register_buffer("cos_sin", build_rope_cache(c, positions, device), persistent=False)
        # Gemma 3: the sliding layers' table, plain RoPE at their own base
        local = None
        if c.sliding_rope_theta is not None:
            local = build_rope_cache(attrs.evolve(c, rope_theta=c.sliding_rope_theta, rope_scaling=None),
                                     positions, device)
        self.register_buffer("cos_sin_local", local, persistent=False)
        if c.mrope_section:     # [head_dim]: the M-RoPE section of each rope column (Qwen2.5-VL)
            self.register_buffer("mrope_columns",
                                 mrope_columns(c.mrope_section, c.head_dim, device),
                                 persistent=False)
        else:
            self.mrope_columns = None
        # GGUF-packed on the CPU: a decode step's layers in one C call where it applies
        # (gpu/kernels/cpu/layer.py FusedDecode, made by the loader), else None. The runner
        # chooses it over forward for a step it can take (gpu/worker/runner.py forward).
        self.fused_decode = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T], positions [T] -> final normed hidden states [T, D]. embeds: (rows
        [R], values [R, D]) put in place of those rows' token embeddings (a picture's
        features at its placeholder tokens, gpu/models/llava_vision.py). An M-RoPE model (Qwen2.5-VL)
        may get positions [3, T] (t, h, w): the step's rows' own cos/sin table is made
        once and read by row. aux_layers (EAGLE3, gpu/worker/spec_decode/eagle.py): the
        layers whose input is captured too (an id equal to the layer count: the last
        layer's output, before the norm); then (hidden, captured [T, len(aux) * D])."""
        x, residual = self.embed(input_ids), None  # [T, D]
        if self.config.embed_scale != 1.0:    # in the table's dtype, as transformers scales it
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        x = x.to(self.residual_dtype)
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        cos_sin = self.cos_sin
        if positions.dim() == 2:
            cos_sin = mrope_cos_sin(cos_sin, positions, self.mrope_columns)
            positions = torch.arange(positions.shape[1], device=positions.device)
        aux = aux_layers
        captured = []
        for i, layer in enumerate(self.layers):
            if aux and i in aux:   # the residual stream entering layer i (vLLM's layer ids)
                captured.append(x if residual is None else x + residual)
            table = self.cos_sin_local if layer.self_attn.local_rope else cos_sin
            x, residual = layer(x, residual, positions, table, attn)
        hidden, last = fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        if aux:
            if len(self.layers) in aux:    # after the last layer, before the final norm
                captured.append(last)
            return hidden, torch.cat(captured, dim=-1)   # [T, D], [T, len(aux) * D]
        return hidden  # [T, D]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, D]. Vocabulary-parallel: each rank looks up the ids in its rows, zeros the
        others, and the all-reduce sums the one row each id has somewhere (exact)."""
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def local_q_heads(self) -> int:
        """Query heads this rank computes (all of them at tensor-parallel size 1)."""
        return self.layers[0].self_attn.num_heads

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and caches: its KV cache's head count."""
        return self.layers[0].self_attn.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, V]: fp32 on CPU (with bf16 weights under an fp32 residual stream, the top
        logits recomputed in fp32: exact_top_logits); in the model's dtype on CUDA, where the
        device sampler reads bf16 directly and whoever needs fp32 (logprobs, grammar masks)
        converts its rows.

        Tensor-parallel: a collective. Each rank computes its vocabulary slice (its exact top
        logits too: a slice's near-top candidates are a superset of the row's, as its largest
        logit is at most the row's); rank 0 gets them gathered, the other ranks None."""
        logits = self.lm_head(hidden)
        if self.vocab_real < logits.shape[-1]:  # padding rows: never the top, never sampled
            logits[:, self.vocab_real:] = float("-inf")
        if not logits.is_cuda:
            logits = logits.float()
            if (hidden.dtype == torch.float32 and isinstance(self.lm_head, Linear)
                    and logits.dtype != self.lm_head.weight.dtype):
                logits = exact_top_logits(logits, hidden, self.lm_head.weight)
        if self.config.final_logit_softcapping:   # Gemma 2; the padding rows stay -inf
            logits = softcap(logits, self.config.final_logit_softcapping)
            if self.vocab_real < logits.shape[-1]:
                logits[:, self.vocab_real:] = float("-inf")
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_first(logits, dim=-1)
        if logits is None or logits.shape[-1] == self.config.vocab_size:
            return logits
        return logits[:, :self.config.vocab_size].contiguous()

    def hf_weight_names(self) -> list[str]:
        """The HF checkpoint names load_weights needs (lm_head.weight only when untied)."""
        names = []
        for name, param in self.named_parameters(remove_duplicate=True):
            prefix, _, kind = name.rpartition(".")  # kind: weight | bias
            module = prefix.rsplit(".", 1)[-1]
            stacked = [hf for hf, (ours, _) in _STACKED.items() if ours == module]
            split = getattr(self.get_submodule(prefix.rsplit(".", 1)[0]), "split", None) if stacked else None
            if module == "qkv_proj" and split:    # a layer without k/v projections (shared KV) or v (k_eq_v)
                stacked = stacked[:len(split)]
            parents = [prefix.rsplit(".", 1)[0] + "." + hf for hf in stacked] or [prefix]
            names += [_to_hf(p) + "." + kind for p in parents]
        return names

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the merged parameters; raises ValueError on unknown, misshapen
        or missing weights. Tensor-parallel: each tensor is cut to this rank's shard on arrival
        (or arrives cut: checkpoint_slices), before anything else is done with it."""
        params = dict(self.named_parameters())
        missing = set(self.hf_weight_names())
        if self.packed_experts:
            named_tensors = self._sharded(_blocks_flattened(named_tensors))
        elif self.config.num_experts and self.config.moe.activation == "swiglu":
            named_tensors = self._sharded(stack_experts(named_tensors, self.config.num_experts))
        elif self.config.num_experts:
            named_tensors = mxfp4.dequantize_pairs(self._sharded(_experts_as_ours(named_tensors)), self.dtype,
                                                   self.embed_tokens.weight.device)
        else:
            named_tensors = self._sharded(named_tensors)
        for hf_name, tensor in named_tensors:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and (
                    self.config.tie_word_embeddings or self.lm_head is None)):
                continue
            if self.config.norm_unit_offset and hf_name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0    # Gemma's (1 + w), in fp32 as transformers adds it
            target, rows = self._destination(hf_name)
            if target not in params or params[target].is_meta:   # is_meta: a weight given its storage since
                params = dict(self.named_parameters())
            if target not in params or params[target].is_meta:
                raise ValueError(f"unexpected weight {hf_name!r} for a {self.config.architecture} model")
            copy_weight(params[target].data[rows], tensor, hf_name, target, self.vocab_real)
            missing.discard(_to_hf(hf_name.removeprefix("model.")))
        missing &= set(self.hf_weight_names())    # less the weights a quantized format took (cuda_linear)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")

    def _destination(self, hf_name: str) -> tuple[str, slice]:
        """Our parameter name for an HF weight, and the rows of it that weight fills."""
        name = hf_name.removeprefix("model.")
        prefix, _, kind = name.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        if module not in _STACKED or isinstance(self.get_submodule(parent), LatentAttention):
            return name, slice(None)
        merged, shard = _STACKED[module]
        sizes = list(self.get_submodule(parent).split) if merged == "qkv_proj" else [self.get_submodule(parent).down_proj.in_features] * 2
        start = sum(sizes[:shard])
        return f"{parent}.{merged}.{kind}", slice(start, start + sizes[shard])

    def shard_spec(self, hf_name: str, ndim: int) -> tuple[int, int, int, int] | str | None:
        """How this rank cuts an HF-named tensor (ours layout, experts [E, out, in], MXFP4 blocks
        [E, out, G, 16] or flattened [E, out, in/2]): (dim, start, stop, full extent), ONCE for a
        row-parallel bias that rank 0 alone adds (the others hold zeros), or None (replicated)."""
        tp, c = self.tp, self.config
        if tp.size == 1:
            return None
        name = our_name(hf_name).removeprefix("model.")
        module, _, kind = name.rpartition(".")
        leaf = module.rsplit(".", 1)[-1]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab_start, self.vocab_start + self.vocab_real, c.vocab_size
        if c.kv_lora_rank and ".self_attn." in name + ".":
            return latent_shard(c, tp, leaf, kind)
        Dh, (q0, q1), (k0, k1) = c.head_dim, q_heads(c, tp), kv_heads(c, tp)
        if leaf == "q_proj":
            return 0, q0 * Dh, q1 * Dh, c.q_size
        if leaf in ("k_proj", "v_proj"):
            return 0, k0 * Dh, k1 * Dh, c.kv_size
        if name.endswith("self_attn.sinks"):
            return 0, q0, q1, c.num_attention_heads
        if leaf == "o_proj":
            return ONCE if kind == "bias" else (1, q0 * Dh, q1 * Dh, c.q_size)
        I = c.intermediate_size  # noqa: E741
        if leaf in ("gate_proj", "up_proj", "down_proj") and ".experts." not in name:
            I = self.get_submodule(module.rpartition(".")[0]).intermediate  # noqa: E741
            i0, i1 = tp.split(I, "intermediate_size")
            return (0, i0, i1, I) if leaf != "down_proj" else (1, i0, i1, I)
        if ".experts." not in name + ".":
            return None
        i0, i1, _ = expert_columns(c, tp, self.packed_experts)
        last = name.rsplit(".", 1)[-1]
        if last.startswith("gate_up_proj"):  # gate and up interleaved along the rows: pairs stay together
            return 1, 2 * i0, 2 * i1, 2 * I
        if last == "down_proj_bias":
            return ONCE
        if last == "down_proj":
            return 2, i0, i1, I
        if last.startswith("down_proj_"):  # MXFP4 blocks or scales: 32 columns to a scale
            per = 16 if last.endswith(mxfp4.BLOCKS_SUFFIX) and ndim == 3 else 1
            return 2, i0 // 32 * per, i1 // 32 * per, I // 32 * per
        return None

    def checkpoint_slices(self, hf_name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of a checkpoint tensor this rank needs, for readers that can read part of
        one (safetensors' get_slice); None: read it whole. Experts stay whole here (their
        checkpoint layout differs from ours; load_weights cuts them)."""
        if ".experts." in hf_name:
            return None
        spec = self.shard_spec(hf_name, len(shape))
        if not isinstance(spec, tuple):
            return None
        dim, start, stop, _ = spec
        return (slice(None),) * dim + (slice(start, stop),)

    def _sharded(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Each tensor cut to this rank's shard (left as it is if it arrived cut)."""
        for name, tensor in named_tensors:
            spec = self.shard_spec(name, tensor.dim())
            if spec == ONCE:
                tensor = tensor if self.tp.first else torch.zeros_like(tensor)
            elif spec is not None:
                dim, start, stop, full = spec
                if tensor.shape[dim] == full and stop - start != full:
                    tensor = tensor.narrow(dim, start, stop - start)
            yield name, tensor


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
    from gpu.layers.ops import cpu_kernels_or_none   # the same, in one C call (gpu/kernels/cpu/ops.c)
    if (c := cpu_kernels_or_none()) is not None and c.exact_top_logits(logits, hidden, weight, _TOP_MARGIN):
        return logits
    top = logits.amax(-1, keepdim=True)
    rows, cols = (logits >= top - top.abs() * _TOP_MARGIN).nonzero(as_tuple=True)
    logits[rows, cols] = (hidden[rows] * weight[cols].float()).sum(-1)
    return logits


ONCE = "once"  # shard_spec: a row-parallel bias, added by rank 0 only

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
