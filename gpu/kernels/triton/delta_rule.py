"""Gated DeltaNet's sequence mixers on CUDA: the gated delta rule's chunked form (a prefill
chunk), its recurrent step (a decode) and the causal conv1d's one-token update. The math
and the torch references are gpu/layers/delta_rule.py's; the states stay in the runner's
StatePool (gpu/layers/linear_attention.py) and are read and written there in place, by slot.

    chunked(q, k, v, g, beta, lens, pool, slots, carried) -> o [B, L, Hv, Dv] fp32
    recurrent_step(q, k, v, g, beta, pool, slots) -> o [B, Hv, Dv] fp32
    conv1d_step(x, weight, conv_pool, slots) -> silu(conv) [B, C]

q, k arrive with Hk heads (each serving Hv / Hk value heads), un-normalised: the kernels
l2-norm them and scale q by 1/sqrt(Dk), as delta_rule._prepare does.

The chunked kernel: one program per (sequence, value head, BV columns of the value dim),
walking the sequence C = 64 tokens at a time with the state tile [Dk, BV] in registers
(delta_rule.py's WY form: A_ij = beta_i k_i.k_j exp(gamma_i - gamma_j), j < i;
U = (I + A)^-1 beta v, W = (I + A)^-1 beta exp(gamma) k; V' = U - W S;
O = q exp(gamma) S + [q k^T exp(gamma_i - gamma_j)]_{j<=i} V';
S <- exp(gamma_C) S + (k exp(gamma_C - gamma))^T V'). The unitriangular inverse is forward
substitution, a row at a time (C steps of C^2 elementwise work), as torch's
solve_triangular and fla's solve_tril do. The shorter product form (I + A)^-1 =
(I - A)(I + A^2)(I + A^4)...(I + A^32), ten matmuls, was tried and dropped: with nearly
parallel keys (A's entries near 1) the powers reach C(63, 32) ~ 1e18 while the inverse
stays of order 1, and fp32 cancels to garbage (the test's "alike" sequence). Each BV tile
recomputes A and its inverse (Dv / BV times). Padded positions past a sequence's length load
k = 0, beta = 0 and g = 0: they write nothing and decay nothing.

The decode kernel: one program per (sequence, value head, BV columns), the [Dk, BV] state
tile loaded from its slot, decayed, corrected, read out and stored back.

Matmuls run in fp32 (input_precision "ieee" by default, DOT_PRECISION): the state
accumulates over a whole sequence and the inverse's products amplify tf32's rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64
DOT_PRECISION = "ieee"


@triton.jit
def _l2norm_rows(x, eps):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps))[:, None]


@triton.jit(do_not_specialize=["L"])
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, lens_ptr, state_ptr, slots_ptr, carried_ptr, o_ptr,
    L, scale,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, so_b, so_t, so_h,
    ss_s, ss_h,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    b, h = pid // HV, pid % HV
    hk = h // REP
    v0 = tl.program_id(1) * BV
    n = tl.load(lens_ptr + b)
    slot = tl.load(slots_ptr + b)
    carried = tl.load(carried_ptr + b) != 0

    rows = tl.arange(0, C)
    kcols = tl.arange(0, BK)
    vcols = v0 + tl.arange(0, BV)
    kmask, vmask = kcols < DK, vcols < DV
    state_off = slot.to(tl.int64) * ss_s + h * ss_h + kcols[:, None] * DV + vcols[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.zeros((BK, BV), dtype=tl.float32)
    if carried & (slot >= 0):
        s = tl.load(state_ptr + state_off, mask=smask, other=0.0)

    lower = rows[:, None] >= rows[None, :]                  # j <= i
    strict = rows[:, None] > rows[None, :]                  # j < i
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    b64 = b.to(tl.int64)
    for c0 in range(0, n, C):
        t = c0 + rows
        tmask = t < n
        q = tl.load(q_ptr + b64 * sq_b + t[:, None] * sq_t + hk * sq_h + kcols[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b64 * sk_b + t[:, None] * sk_t + hk * sk_h + kcols[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b64 * sv_b + t[:, None] * sv_t + h * sv_h + vcols[None, :],
                    mask=tmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b64 * sg_b + t * sg_t + h, mask=tmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b64 * sg_b + t * sg_t + h, mask=tmask, other=0.0).to(tl.float32)
        q = _l2norm_rows(q, 1e-6) * scale
        k = _l2norm_rows(k, 1e-6)
        gamma = tl.cumsum(g, axis=0)                                             # [C]
        last = tl.sum(tl.where(rows == C - 1, gamma, 0.0), axis=0)               # gamma_C
        diff = tl.where(lower, gamma[:, None] - gamma[None, :], float("-inf"))
        decay = tl.exp(diff)                                                     # [C, C], 0 above
        kb = k * beta[:, None]
        a = tl.dot(kb, tl.trans(k), input_precision=PRECISION) * decay
        a = tl.where(strict, a, 0.0)
        # T = (I + A)^-1 by forward substitution, a row at a time: T_i = e_i - A_i T
        inv = eye
        for i in range(1, tl.minimum(n - c0, C)):     # past the length: identity rows
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)                 # [C], 0 at j >= i
            t_i = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)
            inv = tl.where(rows[:, None] == i, t_i[None, :], inv)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)                  # [C, BV]
        w = tl.dot(inv, kb * tl.exp(gamma)[:, None], input_precision=PRECISION)        # [C, BK]
        vn = u - tl.dot(w, s, input_precision=PRECISION)                               # V'
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = tl.dot(q * tl.exp(gamma)[:, None], s, input_precision=PRECISION) + \
            tl.dot(qk, vn, input_precision=PRECISION)
        tl.store(o_ptr + b64 * so_b + t[:, None] * so_t + h * so_h + vcols[None, :], o,
                 mask=tmask[:, None] & vmask[None, :])
        kd = k * tl.exp(last - gamma)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(kd), vn, input_precision=PRECISION)
    if slot >= 0:
        tl.store(state_ptr + state_off, s, mask=smask)


@triton.jit
def _step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr, scale,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, so_b, so_h, ss_s, ss_h,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    pid = tl.program_id(0)
    b, h = pid // HV, pid % HV
    hk = h // REP
    v0 = tl.program_id(1) * BV
    kcols = tl.arange(0, BK)
    vcols = v0 + tl.arange(0, BV)
    kmask, vmask = kcols < DK, vcols < DV
    b64 = b.to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + hk * sq_h + kcols, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b64 * sk_b + hk * sk_h + kcols, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b64 * sv_b + h * sv_h + vcols, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b64 * sg_b + h).to(tl.float32)
    beta = tl.load(beta_ptr + b64 * sg_b + h).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    off = slot * ss_s + h * ss_h + kcols[:, None] * DV + vcols[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(state_ptr + off, mask=smask, other=0.0) * tl.exp(g)              # [BK, BV]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta                           # [BV]
    s = s + k[:, None] * delta[None, :]
    tl.store(state_ptr + off, s, mask=smask)
    tl.store(o_ptr + b64 * so_b + h * so_h + vcols, tl.sum(s * q[:, None], axis=0), mask=vmask)


@triton.jit
def _conv_step_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, out_ptr, sx_b, ss_s, so_b,
                      CH: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """One token of a causal depthwise conv + silu; the state [C, K - 1] shifted by one."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = cols < CH
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * sx_b + cols, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    base = state_ptr + slot * ss_s + cols * (K - 1)
    for j in tl.static_range(K - 1):
        prev = tl.load(base + j, mask=mask, other=0.0)
        acc += prev.to(tl.float32) * tl.load(w_ptr + cols * K + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + j - 1, prev, mask=mask)
    tl.store(base + (K - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * so_b + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(dk: int, dv: int, bv: int) -> tuple[int, int]:
    """BK covers the key dim whole (tl.dot needs 16 at least); BV tiles the value dim."""
    return max(16, triton.next_power_of_2(dk)), max(16, min(bv, triton.next_power_of_2(dv)))


def _check_state(state: torch.Tensor, hv: int, dk: int, dv: int) -> None:
    assert state.dtype == torch.float32 and state.shape[1:] == (hv, dk, dv), \
        f"state {tuple(state.shape)} {state.dtype}, expected [S, {hv}, {dk}, {dv}] float32"
    assert state.stride(3) == 1 and state.stride(2) == dv and state.stride(1) == dk * dv, \
        "each slot's [Hv, Dk, Dv] state must be contiguous"


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            lens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, carried: torch.Tensor,
            ) -> torch.Tensor:
    """B sequences' prefill chunks, right-padded to L: q, k [B, L, Hk, Dk], v [B, L, Hv, Dv]
    (any dtype; rows may be strided views of one projection), g, beta [B, L, Hv], lens [B];
    state [S, Hv, Dk, Dv] fp32, one layer's pool; slots [B] (-1: none, from zeros, not kept),
    carried [B] bool (start from the slot's state, else from zeros). Each sequence's state
    after its last token is left in its slot. -> o [B, L, Hv, Dv] fp32 (rows past a length:
    unwritten)."""
    B, L, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    assert k.shape == q.shape and v.shape[:2] == (B, L) and g.shape == beta.shape == (B, L, Hv)
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1 and g.stride(2) == beta.stride(2) == 1
    assert g.stride() == beta.stride(), "g and beta share their strides"
    assert Hv % Hk == 0, f"{Hv} value heads over {Hk} key heads"
    _check_state(state, Hv, Dk, Dv)
    o = torch.empty(B, L, Hv, Dv, dtype=torch.float32, device=v.device)
    if B == 0 or L == 0:
        return o
    BK, BV = _blocks(Dk, Dv, 32)
    grid = (B * Hv, triton.cdiv(Dv, BV))
    _chunked_kernel[grid](
        q, k, v, g, beta, lens.to(torch.int32), state, slots.to(torch.int32), carried.to(torch.int32), o,
        L, Dk ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        o.stride(0), o.stride(1), o.stride(2), state.stride(0), state.stride(1),
        HV=Hv, REP=Hv // Hk, DK=Dk, DV=Dv, C=CHUNK, BK=BK, BV=BV,
        PRECISION=DOT_PRECISION, num_warps=4, num_stages=1)
    return o


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv];
    state [S, Hv, Dk, Dv] fp32, updated in place at slots [B] -> o [B, Hv, Dv] fp32."""
    B, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == B and g.shape == beta.shape == (B, Hv)
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.stride(1) == beta.stride(1) == 1
    assert g.stride(0) == beta.stride(0), "g and beta share their strides"
    _check_state(state, Hv, Dk, Dv)
    o = torch.empty(B, Hv, Dv, dtype=torch.float32, device=v.device)
    if B == 0:
        return o
    BK, BV = _blocks(Dk, Dv, 32)
    grid = (B * Hv, triton.cdiv(Dv, BV))
    _step_kernel[grid](
        q, k, v, g, beta, state, slots.to(torch.int32), o, Dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        o.stride(0), o.stride(1), state.stride(0), state.stride(1),
        HV=Hv, REP=Hv // Hk, DK=Dk, DV=Dv, BK=BK, BV=BV, num_warps=4)
    return o


def conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor
                ) -> torch.Tensor:
    """One token of B sequences through the causal depthwise conv and silu: x [B, C] (rows may
    be strided), weight [C, K], state [S, C, K - 1] (one layer's conv pool, shifted in place at
    slots [B]) -> [B, C] in x.dtype."""
    B, CH = x.shape
    K = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape[0] == CH
    assert state.shape[1:] == (CH, K - 1) and state.stride(2) == 1 and state.stride(1) == K - 1
    out = torch.empty(B, CH, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    BC = min(1024, triton.next_power_of_2(CH))
    _conv_step_kernel[(B, triton.cdiv(CH, BC))](x, weight, state, slots.to(torch.int32), out,
                                                x.stride(0), state.stride(0), out.stride(0),
                                                CH=CH, K=K, BC=BC, num_warps=4)
    return out


def aot_cases():
    """scripts/check_triton_compile.py's launches: Qwen3-Next-80B's Gated DeltaNet (16 key heads
    and 32 value heads of 128, conv 4 over 8192 channels), bf16 projections, fp32 states: a
    prefill of 4 sequences of 512 tokens and a decode of 32."""
    Hk, Hv, D, S = 16, 32, 128, 64
    bf = dict(dtype=torch.bfloat16)

    def prefill(B=4, L=512):
        f32 = torch.zeros(B, L, Hv)
        chunked(torch.zeros(B, L, Hk, D, **bf), torch.zeros(B, L, Hk, D, **bf), torch.zeros(B, L, Hv, D, **bf),
                f32, f32.clone(), torch.full((B,), L), torch.zeros(S, Hv, D, D), torch.arange(B),
                torch.ones(B, dtype=torch.bool))
    yield "gated_delta_rule chunked[qwen3-next-80b,bf16,4x512]", ["_chunked_kernel"], prefill

    def decode(B=32):
        recurrent_step(torch.zeros(B, Hk, D, **bf), torch.zeros(B, Hk, D, **bf), torch.zeros(B, Hv, D, **bf),
                       torch.zeros(B, Hv), torch.zeros(B, Hv), torch.zeros(S, Hv, D, D), torch.arange(B))
    yield "gated_delta_rule step[qwen3-next-80b,bf16,32 seqs]", ["_step_kernel"], decode

    def conv(B=32, CH=2 * Hk * D + Hv * D):
        conv1d_step(torch.zeros(B, CH, **bf), torch.zeros(CH, 4, **bf), torch.zeros(S, CH, 3, **bf),
                    torch.arange(B))
    yield "causal_conv1d step[qwen3-next-80b,bf16,32 seqs]", ["_conv_step_kernel"], conv
