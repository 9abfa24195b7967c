"""The model's elementwise ops: Triton kernels on CUDA; on the CPU gpu/kernels/cpu/ops.c where it
is built for the norms and rope (one call where torch runs 8-20 small ops, which dominated a
decode step's op count), torch otherwise and for whatever those kernels do not take.

gpu/kernels/ implements the same signatures (and is tested against its own torch
references); on a CUDA tensor each op here dispatches to its kernel. None of them work
in place.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from gpu.config.model import ModelConfig

_DEFERRED = threading.local()


@contextmanager
def weights_deferred(on: bool = True):
    """While on, skip_init leaves every `weight` parameter on the meta device (no memory): a
    pre-quantized checkpoint's load on CUDA (gpu/quantization/cuda_linear.py KernelForms) builds
    the model so, then gives real storage to the weights that stay dense and none to the
    linears it replaces by their packed form."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = on
    try:
        yield
    finally:
        _DEFERRED.on = before


def skip_init(cls, *args, device=None, dtype=None, **kwargs):
    """cls(*args, **kwargs) with its parameters allocated on `device` and left uninitialized.
    torch.nn.utils.skip_init does the same through to_empty, whose empty_like on meta
    tensors runs torch's Python reference and imports sympy on its first call: 0.5 s of
    every process start. Here each parameter is a plain torch.empty (a weight under
    weights_deferred: left on the meta device)."""
    m = cls(*args, device="meta", dtype=dtype, **kwargs)
    deferred = getattr(_DEFERRED, "on", False)
    for mod in m.modules():
        for name, p in mod._parameters.items():
            if p is not None and not (deferred and name == "weight"):
                mod._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    return m


def _cpu():
    """gpu/cpu_kernels, or None (not built, or TAILRACE_CPU_KERNELS=0): the torch code below."""
    from gpu.kernels.cpu import ops as cpu_kernels
    return cpu_kernels.kernels()


def cpu_kernels_or_none():
    """What the CPU ops here use (gpu/model.exact_top_logits shares it)."""
    return _cpu()


def _kernel(module: str, name: str):
    """A Triton launcher, imported on first use (the CPU path never imports triton)."""
    import importlib

    return getattr(importlib.import_module(f"gpu.kernels.triton.{module}"), name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, D], weight [D] -> [N, D]; statistics and scaling in fp32, result in x.dtype."""
    if x.is_cuda:
        return _kernel("rmsnorm", "rms_norm")(x, weight, eps)
    if (c := _cpu()) is not None and (r := c.add_rms_norm(x, None, weight, eps)) is not None:
        return r[0]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); both [N, D]."""
    if x.is_cuda:
        return _kernel("rmsnorm", "fused_add_rms_norm")(x, residual, weight, eps)
    if (c := _cpu()) is not None and (r := c.add_rms_norm(x, residual, weight, eps)) is not None:
        return r
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2*I] -> silu(x[:, :I]) * x[:, I:], [N, I]."""
    if x.is_cuda:
        return _kernel("activation", "silu_and_mul")(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2*I] -> gelu_tanh(x[:, :I]) * x[:, I:], [N, I] (GeGLU with GELU's tanh
    approximation, Gemma's MLP), in fp32 then x.dtype as transformers' fp32 run computes it."""
    if x.is_cuda:
        return _kernel("activation", "gelu_tanh_and_mul")(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x itself when cap is None."""
    return x if not cap else torch.tanh(x / cap) * cap


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale (yarn's attention factor), as in
    transformers' ROPE_INIT_FUNCTIONS."""
    dim, base = config.rope_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if dim < config.head_dim:   # partial rotary: the other frequencies turn nothing
        inv_freq = torch.cat([inv_freq, inv_freq.new_zeros((config.head_dim - dim) // 2)])
    s = config.rope_scaling_dict
    rope_type = s.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / s["factor"], 1.0
    if rope_type == "proportional":   # Gemma 4's full layers: the first fraction of head_dim's frequencies turn
        d = config.head_dim
        n = int(s.get("partial_rotary_factor", 1.0) * d // 2)
        turning = 1.0 / (base ** (torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / d))
        return torch.cat([turning, turning.new_zeros(d // 2 - n)]) / s.get("factor", 1.0), 1.0
    if rope_type == "llama3" and "freq_factors" in s:   # a GGUF's rope_freqs (gpu/formats/gguf.py)
        factors = torch.tensor(s["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for head_dim {dim} ({dim // 2} frequencies)")
        return inv_freq / factors, 1.0
    if rope_type == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        # Between the two wavelength bounds, blend unscaled and scaled frequencies smoothly.
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, inv_freq, s)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _yarn_inv_freq(config: ModelConfig, inv_freq: torch.Tensor, s: dict) -> tuple[torch.Tensor, float]:
    dim, base = config.rope_dim, config.rope_theta
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:  # dimension index that completes `rotations` turns
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 -> keep the original (extrapolated) frequency; ramp 1 -> interpolate (divide by factor).
    pos_freqs = 1.0 / inv_freq
    return ramp / (factor * pos_freqs) + (1 - ramp) / pos_freqs, float(attention_factor)


def build_rope_cache(
    config: ModelConfig, max_positions: int, device: torch.device | str | None = None, dtype=torch.float32
) -> torch.Tensor:
    """[max_positions, D]: cos in the first D/2 columns, sin in the second half; D is
    head_dim, or under partial rotary the dims RoPE turns (config.rope_dim: GLM-4.5, Phi-4-mini;
    the attention turns those first dims and leaves the rest, causal_lm.partial_rope).
    LongRoPE: the short factors' frequencies up to original_max_position_embeddings, the long
    ones from there (vLLM's table; transformers switches a whole sequence to the long ones once
    it is longer)."""
    if config.rope_scaling_dict.get("rope_type") == "longrope":
        return _longrope_cache(config, max_positions).to(device=device, dtype=dtype)
    inv_freq, scale = rope_inv_freq(config)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, Dh/2]
    cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)  # [P, Dh]
    return _narrowed(cache, config).to(device=device, dtype=dtype)


def _narrowed(cache: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Partial rotary: the table of the rope_dim / 2 frequencies that turn, [P, rope_dim]."""
    if config.rope_dim >= config.head_dim:
        return cache
    half, n = config.head_dim // 2, config.rope_dim // 2
    return torch.cat([cache[:, :n], cache[:, half:half + n]], dim=-1).contiguous()


def _longrope_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    s = config.rope_scaling_dict
    dim = config.rope_dim
    old = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old
    scale = s.get("attention_factor") or (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old)))
    base = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.zeros(max_positions, config.head_dim // 2)
    for key, rows in (("short_factor", pos < old), ("long_factor", pos >= old)):
        ext = torch.tensor(s[key], dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(f"longrope {key} has {ext.numel()} entries for {dim // 2} frequencies")
        freqs[rows, :dim // 2] = torch.outer(pos[rows], 1.0 / (ext * base))
    cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    return _narrowed(cache, config)


def mrope_columns(section: tuple[int, ...], head_dim: int, device=None) -> torch.Tensor:
    """[head_dim]: which of the (t, h, w) positions each cos/sin column of the rope table
    takes under M-RoPE: frequency j of the first section's j's the temporal one, the next
    section's the height, the last's the width (cos and sin halves alike)."""
    if sum(section) * 2 != head_dim:
        raise ValueError(f"mrope_section {list(section)} does not sum to head_dim/2 = "
                         f"{head_dim // 2}")
    half = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    return torch.cat([half, half]).to(device)


def mrope_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor
                  ) -> torch.Tensor:
    """M-RoPE as one position a token: positions [3, T] (t, h, w) -> a [T, head_dim] table
    whose row i holds token i's cos/sin, each column from the position its section takes
    (mrope_columns); apply_rope then reads it with positions arange(T)."""
    rows = cos_sin[positions]                                   # [3, T, Dh]
    return rows.gather(0, columns.view(1, 1, -1).expand(1, rows.shape[1], -1))[0]


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, Dh], k [T, Hkv, Dh], positions [T] -> rotated (q, k), NeoX/HF rotate_half layout."""
    if q.is_cuda:
        return _kernel("rope", "apply_rope")(q, k, positions, cos_sin)
    if (c := _cpu()) is not None and (r := c.rope(q, k, positions, cos_sin)) is not None:
        return r
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)  # [T, 1, Dh/2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
