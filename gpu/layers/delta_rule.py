"""Gated DeltaNet's two sequence mixers, in torch: the causal depthwise conv1d with its
rolling state, and the gated delta rule with its [heads, key dim, value dim] state.

The gated delta rule (Yang, Kautz, Hatamizadeh 2024), per value head, state S [Dk, Dv]:

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T      a_t = exp(g_t) in (0, 1]
    o_t = S_t^T q_t                                                   (q, k l2-normed, q / sqrt(Dk))

`recurrent_step` takes one token a sequence (decode). `chunked` takes a prefill chunk,
C = 64 tokens at a time (the WY form of flash-linear-attention's chunk kernel): with
gamma_i the cumulative log decay inside a chunk and A the strictly lower triangular
A_ij = beta_i k_i.k_j exp(gamma_i - gamma_j),

    U = (I + A)^-1 (beta v)           W = (I + A)^-1 (beta exp(gamma) k)
    V' = U - W S                      (what each token writes, the old state's part removed)
    O = (q exp(gamma)) S + [q k^T exp(gamma_i - gamma_j)]_{j <= i} V'
    S <- exp(gamma_C) S + (k exp(gamma_C - gamma))^T V'

Both are exact reorderings of the recurrence (tests/gpu/test_delta_rule.py: each against
the other, and against transformers' Qwen3-Next references), so a prefill split into
chunks anywhere, its state carried between them, computes what one pass does.
Everything runs in fp32; q and k arrive with Hk heads and serve Hv / Hk value heads each.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Over the last dimension, as flash-linear-attention's kernels (and transformers) do."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> fp32, l2-normed, q scaled by 1/sqrt(Dk), repeated to Hv heads."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if q.shape[-2] != heads:
        rep = heads // q.shape[-2]
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv],
    state [B, Hv, Dk, Dv] fp32 -> (o [B, Hv, Dv] fp32, the new state)."""
    q, k = _prepare(q, k, v.shape[-2])
    B, H, Dk, Dv = state.shape
    s = (state * g.float().exp()[..., None, None]).view(B * H, Dk, Dv)
    k1, q1 = k.reshape(B * H, 1, Dk), q.reshape(B * H, 1, Dk)
    kv = torch.bmm(k1, s)                                         # what S already predicts for k
    delta = (v.float().reshape(B * H, 1, Dv) - kv) * beta.float().reshape(B * H, 1, 1)
    s.baddbmm_(k1.transpose(1, 2), delta)                         # S += k delta^T, in place
    return torch.bmm(q1, s).view(B, H, Dv), s.view(B, H, Dk, Dv)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token (the reference `chunked` is tested against): q, k [L, Hk, Dk],
    v [L, Hv, Dv], g, beta [L, Hv], state [Hv, Dk, Dv] or None (zeros) -> (o [L, Hv, Dv], state)."""
    L, H, Dv = v.shape
    s = (torch.zeros(1, H, k.shape[-1], Dv, device=v.device) if state is None
         else state.float()[None])
    out = []
    for t in range(L):
        o, s = recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        out.append(o)
    return torch.cat(out), s[0]


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None = None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill chunk: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv], state
    [Hv, Dk, Dv] or None (zeros) -> (o [L, Hv, Dv] fp32, the state after the last token)."""
    L, H, Dv = v.shape
    q, k = _prepare(q, k, H)
    Dk = k.shape[-1]
    chunk = min(chunk, L)           # a short prefill chunk: one block of its own size
    pad = (-L) % chunk
    # [H, N, C, D]: heads first, the sequence cut into N chunks of C
    def cut(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.float().transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(H, -1, chunk, *x.shape[2:])
    q, k, v, g, beta = cut(q), cut(k), cut(v), cut(g), cut(beta)
    gamma = g.cumsum(-1)                                          # [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay                        # diagonal ignored: unitriangular
    eye = torch.eye(chunk, device=v.device)
    t = torch.linalg.solve_triangular(a.tril(-1) + eye, torch.cat(
        [v * beta[..., None], kb * gamma.exp()[..., None]], dim=-1), upper=False, unitriangular=True)
    u, w = t.split([Dv, Dk], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay                      # [H, N, C, C], causal
    qd = q * gamma.exp()[..., None]
    last = gamma[..., -1:]                                        # [H, N, 1]
    kd = k * (last - gamma).exp()[..., None]
    s = (torch.zeros(H, Dk, Dv, device=v.device) if state is None else state.float().clone())
    out = torch.empty_like(u)
    for n in range(q.shape[1]):
        vn = u[:, n] - w[:, n] @ s                                # [H, C, Dv]
        out[:, n] = qd[:, n] @ s + attn[:, n] @ vn
        s = s * last[:, n, :, None].exp() + kd[:, n].transpose(-1, -2) @ vn
    return out.reshape(H, -1, Dv)[:, :L].transpose(0, 1), s


def conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one sequence's chunk, then silu: x [L, C], weight [C, K],
    state [C, K - 1] (the K - 1 inputs before this chunk; None: zeros, a sequence's start)
    -> (out [L, C] in x.dtype, the new state [C, K - 1]: the last K - 1 inputs)."""
    L, C = x.shape
    K = weight.shape[-1]
    prev = x.new_zeros(C, K - 1) if state is None else state.to(x.dtype)
    full = torch.cat([prev, x.t()], dim=-1)                       # [C, K - 1 + L]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None], groups=C)[0]   # [C, L]
    return F.silu(out).t().to(x.dtype), full[:, -(K - 1):]


def conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: x [B, C], state [B, C, K - 1] -> (out [B, C], new state)."""
    full = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    out = (full.to(weight.dtype) * weight).sum(-1)
    return F.silu(out).to(x.dtype), full[..., 1:]
