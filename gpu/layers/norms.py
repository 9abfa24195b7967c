"""The norms of the Qwen3-Next / Qwen3.5 hybrids (torch; statistics in fp32).

OffsetRMSNorm scales by (1 + w): the checkpoints store w zero-centred, and the sum is
taken in fp32 at every call (folding it into a bf16 weight would round 1 + w to 8 bits,
where w alone keeps its own). GatedRMSNorm is Gated DeltaNet's output norm: a plain RMSNorm
over each value head, then times silu(gate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, D], weight [D] -> x / rms(x) * (1 + weight), in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, D], gate [N, D], weight [D] -> x / rms(x) * weight * silu(gate), in x.dtype.
    (transformers rounds the normed x times weight to x.dtype before the gate; the same
    in fp32, within one rounding in bf16.)"""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float() * F.silu(gate.float())).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
