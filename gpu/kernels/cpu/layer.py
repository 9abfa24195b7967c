"""A decode step's whole decoder stack in one C call on the CPU (issue 39): gpu/kernels/cpu/layer.c,
built and cached like gpu/kernels/cpu/ops.c, over a model whose linears are all GGUF-packed
(gpu/quantization/gguf.py). Where the torch path runs ~20 small ops and a dozen Python frames per
layer (norms, packed GEMVs, rope, the KV write, gather + SDPA, silu * mul), this is one ctypes
call per step whose per-layer phases are separated by OpenMP barriers, with no allocation.

When it runs (`FusedDecode.__call__`; None otherwise, and the caller's torch path serves):
- the model: every layer's qkv/o/gate_up/down a PackedLinear (a llama-family dense MLP), fp32
  norms and residual stream, no attention sinks or sliding window, no M-RoPE, one rank;
- the step: every row a decode row (one token a sequence, or a verify's short chunk after a
  cached context: a row per position, each seeing the keys up to its own, every row's k/v
  written before any attends: `Step.chunked`), at most MAX_ROWS of them, through
  gpu/layers/attention.py's TorchPagedAttention over an fp32 cache without sliding layers; no forward
  hooks on the linears (LoRA's term needs the base output), no pictures, no EAGLE capture.

TAILRACE_FUSED_LAYERS=0 turns it off (the A/B switch, docs/cli.md); so does
TAILRACE_CPU_KERNELS=0, which builds no C at all. `FusedDecode.enabled` switches it per model
(scripts/profile_cpu_step.py --fused on off).

Imports: cpu_layer -> cpu_kernels, cpu_quant, attention (model.py imports it lazily)."""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch.nn.modules import module as _module

from gpu.kernels.cpu import ops as cpu_kernels

from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.attention import TorchPagedAttention

ENV = "TAILRACE_FUSED_LAYERS"    # "0": never use it
MAX_ROWS = cpu_quant.LARGE_M     # decode rows per step (measured up to 48; more: the per-layer path)
_SOURCE = Path(__file__).with_name("layer.c")
_I64, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SEG = 3


class _Lin(ctypes.Structure):
    _fields_ = [("nseg", _I64), ("K", _I64), ("N", _I64), ("fmt", _I64 * _SEG), ("rows", _I64 * _SEG),
                ("row_bytes", _I64 * _SEG), ("w", _P * _SEG), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin), ("ln1", _P), ("ln2", _P),
                ("q_norm", _P), ("k_norm", _P), ("k_cache", _P), ("v_cache", _P)]


class _Model(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("n_layers", "D", "Hq", "Hkv", "Dh", "I", "bs", "num_blocks", "P")] + [
        ("eps", _F), ("scale", _F), ("cos_sin", _P), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("M", _I64), ("x", _P), ("hidden", _P), ("positions", _P), ("slots", _P), ("tables", _P),
                ("table_stride", _I64), ("seq_lens", _P), ("chunked", _I64)]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built gpu/kernels/cpu/layer.c, or None (off, no compiler, a failed build)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    lib = cpu_kernels.load_library(_SOURCE)
    if lib is None:
        return None
    lib.cpu_layers_decode.restype = ctypes.c_int
    lib.cpu_layers_decode.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    lib.cpu_layer_vector_width.restype = ctypes.c_int
    return lib


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")


def eligible(lm) -> bool:
    """Whether lm's structure is one the C stack computes (the step's checks come later)."""
    from gpu.models.causal_lm import MLP
    c = lm.config
    if lm.tp.size != 1 or c.mrope_section or c.attention_sinks or lm.residual_dtype != torch.float32:
        return False
    if (c.hidden_act != "silu" or c.sandwich_norms or c.embed_scale != 1.0 or c.q_scale != 1.0
            or c.attn_logit_softcapping or c.sliding_rope_theta is not None):
        return False    # Gemma's parts: the C stack computes Llama's layer only
    for i, layer in enumerate(lm.layers):
        a = layer.self_attn
        if not isinstance(layer.mlp, MLP) or a.sinks is not None or c.layer_window(i) is not None:
            return False
        for lin in (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(lin, cpu_quant.PackedLinear) or len(lin.formats) > _SEG:
                return False
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if a.q_norm is not None:
            norms += [a.q_norm.weight, a.k_norm.weight]
        if not all(_fp32(t) for t in norms):
            return False
    return _fp32(lm.norm.weight) and _fp32(lm.cos_sin)


def _lin(lin: cpu_quant.PackedLinear, keep: list) -> _Lin:
    s = _Lin(nseg=len(lin.formats), K=lin.in_features, N=lin.out_features)
    for j, (fmt, w) in enumerate(lin._segments()):
        s.fmt[j], s.rows[j], s.row_bytes[j], s.w[j] = fmt, w.shape[0], w.shape[1], w.data_ptr()
        keep.append(w)
    if lin.bias is not None:
        s.bias = lin.bias.data_ptr()
        keep.append(lin.bias)
    return s


class FusedDecode:
    """One model's C decoder stack: `fused(input_ids, positions, attn)` -> the final normed
    hidden states [M, D] of a decode step, or None where it does not apply."""

    def __init__(self, lm, lib: ctypes.CDLL) -> None:
        self.lm = lm
        self._fn = lib.cpu_layers_decode
        self.enabled = True
        self._model: _Model | None = None
        self._key: tuple = ()
        self._keep: list = []
        self._step = _Step()
        self._step_ref = ctypes.byref(self._step)
        self._linears = [m for layer in lm.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    @classmethod
    def for_model(cls, lm) -> FusedDecode | None:
        lib = library()
        return cls(lm, lib) if lib is not None and eligible(lm) else None

    def _build(self, cache) -> _Model:
        """The C structs for this model and cache (again for another cache, and after
        `invalidate`: sleep mode drops and remakes the cache's and the weights' storage)."""
        lm, c, keep = self.lm, self.lm.config, []
        layers = (_Layer * len(lm.layers))()
        for i, layer in enumerate(lm.layers):
            a, mlp, s = layer.self_attn, layer.mlp, layers[i]
            s.qkv, s.o = _lin(a.qkv_proj, keep), _lin(a.o_proj, keep)
            s.gate_up, s.down = _lin(mlp.gate_up_proj, keep), _lin(mlp.down_proj, keep)
            s.ln1, s.ln2 = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
            if a.q_norm is not None:
                s.q_norm, s.k_norm = a.q_norm.weight.data_ptr(), a.k_norm.weight.data_ptr()
            s.k_cache, s.v_cache = cache.k[i].data_ptr(), cache.v[i].data_ptr()
        a0 = lm.layers[0].self_attn
        nb, bs, hkv, dh = cache.k[0].shape
        self._keep = [layers, *keep, lm.norm.weight, lm.cos_sin]
        return _Model(n_layers=len(lm.layers), D=c.hidden_size, Hq=a0.num_heads, Hkv=hkv, Dh=dh,
                      I=lm.layers[0].mlp.down_proj.in_features, bs=bs, num_blocks=nb, P=lm.cos_sin.shape[0],
                      eps=lm.layers[0].input_layernorm.eps, scale=c.head_dim ** -0.5,
                      cos_sin=lm.cos_sin.data_ptr(), final_norm=lm.norm.weight.data_ptr(),
                      layers=ctypes.cast(layers, ctypes.POINTER(_Layer)))

    def invalidate(self) -> None:
        """Rebuild the C structs on the next step: the cache's or the weights' storage was
        replaced (gpu/worker/sleep.py calls it on every wake-up)."""
        self._model = None

    @staticmethod
    def _decodes(meta, M: int) -> bool:
        """Every row attends as a decode row: one token a sequence, or a verify's short
        chunk after a cached context (TorchPagedAttention's SHORT_CHUNK rule), each row
        seeing the keys up to its own position."""
        if not meta.prefill_rows:
            return len(meta.decode_rows) == M
        short = TorchPagedAttention.SHORT_CHUNK
        return all(meta.q_lens[r] <= short and meta.start_positions[r] > 0 for r in meta.prefill_rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        if not self.enabled or type(attn) is not TorchPagedAttention or torch.is_grad_enabled():
            return None
        meta, cache = attn.meta, attn.cache
        M = input_ids.shape[0]
        if (meta is None or M > MAX_ROWS or M == 0 or not self._decodes(meta, M)
                or positions.dim() != 1 or cache.sliding_layers or cache.k[0].dtype != torch.float32
                or cache.k[0].device.type != "cpu" or cache.k[0].shape[2] != self.lm.local_kv_heads):
            return None
        if (_module._global_forward_hooks or _module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in self._linears)):
            return None   # LoRA (or anything else) hooks a linear: the torch path calls it
        key = (id(cache), cache.k[0].data_ptr(), cache.v[-1].data_ptr(), len(cache.k))
        if self._model is None or key != self._key:
            self._model = self._build(cache)
            self._model_ref = ctypes.byref(self._model)
            self._key = key
        x = self.lm.embed_tokens(input_ids)
        if x.dtype != torch.float32:
            x = x.float()
        hidden = torch.empty(M, x.shape[1], dtype=torch.float32)
        tables, lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
        pos = positions if positions.dtype == torch.int64 else positions.long()
        chunked = bool(meta.prefill_rows)
        if chunked:     # a row per position: its sequence's table, the keys up to its own
            rows_of = torch.repeat_interleave(torch.arange(len(meta.q_lens)),
                                              torch.tensor(meta.q_lens))
            tables = tables.index_select(0, rows_of.to(tables.device)).contiguous()
            lens = (pos + 1).to(torch.int32)
        if not (tables.dtype == torch.int32 and tables.is_contiguous() and lens.dtype == torch.int32
                and slots.dtype == torch.int64 and pos.is_contiguous() and x.is_contiguous()):
            return None
        st = self._step
        st.M, st.x, st.hidden, st.positions = M, x.data_ptr(), hidden.data_ptr(), pos.data_ptr()
        st.slots, st.tables, st.table_stride, st.seq_lens = (slots.data_ptr(), tables.data_ptr(),
                                                            tables.shape[1], lens.data_ptr())
        st.chunked = int(chunked)
        with torch.profiler.record_function("cpu_layer::decode_stack"):
            rc = self._fn(self._model_ref, self._step_ref)
        return hidden if rc == 0 else None


def describe(lm) -> str:
    """The start-up line's clause (empty when the C stack does not serve this model)."""
    f = getattr(lm, "fused_decode", None)
    if f is None:
        return ""
    source = getattr(f, "SOURCE", "gpu/kernels/cpu/layer.c")
    return f"; decode steps of up to {MAX_ROWS} rows: the whole decoder stack in one C call ({source})"
