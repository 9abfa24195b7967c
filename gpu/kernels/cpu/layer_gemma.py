"""Gemma 3's decode step's decoder stack in one C call (issue 55): gpu/kernels/cpu/layer_gemma.c,
layer.c's C stack (its tiles, q/k norm + RoPE + KV write, barriers, arena) with Gemma's layer:
the (1 + w) sandwich norms around attention and the MLP, GeGLU with GELU's tanh approximation,
QK-norm, query_pre_attn_scalar, a RoPE table per layer type, and sliding-window layers on the
hybrid cache's sliding pool (or in the plain cache). The √hidden embedding scale is applied
here, in the table's dtype, as CausalLM.forward does.

When it runs: a Gemma 3 model (sandwich norms, gelu_pytorch_tanh, no soft-capping: Gemma 2's
caps are not computed here) whose linears are all PackedLinears, fp32 norms and residual stream,
one rank; the step's rules are FusedDecode's (gpu/kernels/cpu/layer.py): decode rows (or a
verify's short chunk), TorchPagedAttention over an fp32 cache, no hooks on the linears.
TAILRACE_FUSED_LAYERS=0 turns it off too; `enabled` switches it per model."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch.nn.modules import module as _module

from gpu.kernels.cpu import layer as cpu_layer
from gpu.kernels.cpu import ops as cpu_kernels
from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.attention import TorchPagedAttention

_SOURCE = Path(__file__).with_name("layer_gemma.c")
_I64, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_Lin = cpu_layer._Lin


class _GLayer(ctypes.Structure):
    _fields_ = [("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin)] + [
        (n, _P) for n in ("ln1", "post_attn", "pre_ff", "post_ff", "q_norm", "k_norm", "k_cache", "v_cache",
                          "cos_sin")] + [("window", _I64), ("pool", _I64), ("num_blocks", _I64)]


class _GModel(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("n_layers", "D", "Hq", "Hkv", "Dh", "I", "bs", "P")] + [
        ("eps", _F), ("scale", _F), ("final_norm", _P), ("layers", ctypes.POINTER(_GLayer))]


class _GStep(ctypes.Structure):
    _fields_ = [("M", _I64), ("x", _P), ("hidden", _P), ("positions", _P), ("slots", _P * 2),
                ("tables", _P * 2), ("table_stride", _I64), ("seq_lens", _P), ("chunked", _I64)]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built gpu/kernels/cpu/layer_gemma.c, or None (off, no compiler, a failed build)."""
    if cpu_layer.library() is None:    # TAILRACE_FUSED_LAYERS=0, TAILRACE_CPU_KERNELS=0, no compiler
        return None
    lib = cpu_kernels.load_library(_SOURCE)
    if lib is None:
        return None
    lib.cpu_gemma_decode.restype = ctypes.c_int
    lib.cpu_gemma_decode.argtypes = [ctypes.POINTER(_GModel), ctypes.POINTER(_GStep)]
    lib.cpu_gemma_vector_width.restype = ctypes.c_int
    return lib


def eligible(lm) -> bool:
    """Whether lm is a Gemma 3 whose structure the C stack computes."""
    from gpu.models.causal_lm import MLP
    c = lm.config
    if lm.tp.size != 1 or c.mrope_section or c.attention_sinks or lm.residual_dtype != torch.float32:
        return False
    if (c.hidden_act != "gelu_pytorch_tanh" or not c.sandwich_norms or not c.norm_unit_offset
            or c.attn_logit_softcapping or c.rope_dim != c.head_dim):
        return False
    fp32 = cpu_layer._fp32
    for layer in lm.layers:
        a = layer.self_attn
        if not isinstance(layer.mlp, MLP) or a.sinks is not None or a.q_norm is None:
            return False
        for lin in (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(lin, cpu_quant.PackedLinear) or len(lin.formats) > cpu_layer._SEG:
                return False
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                 layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight,
                 a.q_norm.weight, a.k_norm.weight]
        if not all(fp32(t) for t in norms):
            return False
    tables = [lm.cos_sin] + ([lm.cos_sin_local] if lm.cos_sin_local is not None else [])
    return fp32(lm.norm.weight) and all(fp32(t) and t.shape == lm.cos_sin.shape for t in tables)


class GemmaDecode(cpu_layer.FusedDecode):
    """FusedDecode for Gemma 3: `fused(input_ids, positions, attn)` -> the final normed hidden
    states [M, D] of a decode step, or None where it does not apply."""

    SOURCE = "gpu/kernels/cpu/layer_gemma.c"     # named in the start-up line (layer.describe)

    def __init__(self, lm, lib: ctypes.CDLL) -> None:
        super().__init__(lm, lib)
        self._fn = lib.cpu_gemma_decode
        self._step = _GStep()
        self._step_ref = ctypes.byref(self._step)
        c = lm.config
        self._scale = torch.tensor(c.embed_scale, dtype=lm.embed_tokens.weight.dtype)
        self._attn_scale = float(c.query_pre_attn_scalar or c.head_dim) ** -0.5

    @classmethod
    def for_model(cls, lm) -> GemmaDecode | None:
        if not eligible(lm):     # first: no other family builds layer_gemma.c (~7 s of CPU, once a machine)
            return None
        lib = library()
        return cls(lm, lib) if lib is not None else None

    def _build(self, cache) -> _GModel:
        lm, c, keep = self.lm, self.lm.config, []
        _lin = cpu_layer._lin
        layers = (_GLayer * len(lm.layers))()
        for i, layer in enumerate(lm.layers):
            a, mlp, s = layer.self_attn, layer.mlp, layers[i]
            s.qkv, s.o = _lin(a.qkv_proj, keep), _lin(a.o_proj, keep)
            s.gate_up, s.down = _lin(mlp.gate_up_proj, keep), _lin(mlp.down_proj, keep)
            s.ln1, s.post_attn = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
            s.pre_ff = layer.pre_feedforward_layernorm.weight.data_ptr()
            s.post_ff = layer.post_feedforward_layernorm.weight.data_ptr()
            s.q_norm, s.k_norm = a.q_norm.weight.data_ptr(), a.k_norm.weight.data_ptr()
            s.k_cache, s.v_cache = cache.k[i].data_ptr(), cache.v[i].data_ptr()
            s.cos_sin = (lm.cos_sin_local if a.local_rope else lm.cos_sin).data_ptr()
            s.window = a.window or 0
            s.pool = int(i in cache.sliding_layers)
            s.num_blocks = cache.k[i].shape[0]
        a0 = lm.layers[0].self_attn
        _, bs, hkv, dh = cache.k[0].shape
        self._keep = [layers, *keep, lm.norm.weight, lm.cos_sin, lm.cos_sin_local]
        return _GModel(n_layers=len(lm.layers), D=c.hidden_size, Hq=a0.num_heads, Hkv=hkv, Dh=dh,
                       I=lm.layers[0].mlp.down_proj.in_features, bs=bs, P=lm.cos_sin.shape[0],
                       eps=lm.layers[0].input_layernorm.eps, scale=self._attn_scale,
                       final_norm=lm.norm.weight.data_ptr(), layers=ctypes.cast(layers, ctypes.POINTER(_GLayer)))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        if not self.enabled or type(attn) is not TorchPagedAttention or torch.is_grad_enabled():
            return None
        meta, cache = attn.meta, attn.cache
        M = input_ids.shape[0]
        if (meta is None or M > cpu_layer.MAX_ROWS or M == 0 or not self._decodes(meta, M)
                or positions.dim() != 1 or cache.k[0].dtype != torch.float32
                or cache.k[0].device.type != "cpu" or cache.k[0].shape[2] != self.lm.local_kv_heads):
            return None
        if (_module._global_forward_hooks or _module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in self._linears)):
            return None
        key = (id(cache), cache.k[0].data_ptr(), cache.v[-1].data_ptr(), len(cache.k), cache.sliding_layers)
        if self._model is None or key != self._key:
            self._model = self._build(cache)
            self._model_ref = ctypes.byref(self._model)
            self._key = key
        x = self.lm.embed_tokens(input_ids)
        x = x * self._scale            # in the table's dtype, as CausalLM.forward scales it
        if x.dtype != torch.float32:
            x = x.float()
        hidden = torch.empty(M, x.shape[1], dtype=torch.float32)
        pos = positions if positions.dtype == torch.int64 else positions.long()
        chunked = bool(meta.prefill_rows)
        views = [meta] + ([cache.sliding_view(meta)] if cache.sliding_layers else [])
        tables, slots = [], []
        rows_of = None
        if chunked:     # a row per position: its sequence's table, the keys up to its own
            rows_of = torch.repeat_interleave(torch.arange(len(meta.q_lens)), torch.tensor(meta.q_lens))
            lens = (pos + 1).to(torch.int32)
        else:
            lens = meta.seq_lens
        for v in views:
            t = v.block_tables
            if rows_of is not None:
                t = t.index_select(0, rows_of.to(t.device))
            t = t.to(torch.int32).contiguous()
            s = v.slot_mapping if v.slot_mapping.dtype == torch.int64 else v.slot_mapping.long()
            tables.append(t)
            slots.append(s.contiguous())
        if not (lens.dtype == torch.int32 and lens.is_contiguous() and pos.is_contiguous() and x.is_contiguous()):
            return None
        st = self._step
        st.M, st.x, st.hidden, st.positions = M, x.data_ptr(), hidden.data_ptr(), pos.data_ptr()
        for p in range(2):
            j = min(p, len(views) - 1)
            st.slots[p], st.tables[p] = slots[j].data_ptr(), tables[j].data_ptr()
        st.table_stride, st.seq_lens, st.chunked = tables[0].shape[1], lens.data_ptr(), int(chunked)
        self._step_keep = (x, tables, slots, lens, pos)
        with torch.profiler.record_function("cpu_layer::gemma_decode_stack"):
            rc = self._fn(self._model_ref, self._step_ref)
        return hidden if rc == 0 else None
