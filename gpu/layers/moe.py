"""The mixture-of-experts layer: a router whose strategy the config chooses
(gpu/config/moe.py MoESpec: gpt-oss, Qwen3-MoE/Mixtral, DeepSeek-V3/GLM-4.5, Llama 4), the
experts run as a grouped matmul over the routed rows, an optional shared expert.

Routing (route): router logits = x W_r^T (+ b_r); softmax scoring takes each token's top-k
experts and weighs them by a softmax over those k logits (norm_topk_prob, gpt-oss and Mixtral)
or by their share of the softmax over all experts (Qwen3-MoE without norm_topk_prob). Sigmoid
scoring (DeepSeek-V3) chooses by sigmoid(logit) + e_score_correction_bias within the
topk_group best groups and weighs by the uncorrected sigmoid, renormalised and scaled; Llama
4's top-1 sigmoid multiplies the expert's input instead of its output.

Each (token, expert) pair is one row of a grouped GEMM: the rows are sorted by expert so that
each expert's rows are one contiguous segment, and one `grouped_mm` call multiplies every
segment by its own expert's weights (no loop over experts on CUDA; on the CPU only the
routed experts' weights are read and no expert runs on tokens not routed to it). The k outputs
of a token are put back in (token, slot) order and summed, so the result does not depend on
atomics.

Expert weights are stored [E, out, in] (the checkpoint's MXFP4 layout, like nn.Linear), with
gate and up interleaved along gate_up's output rows: gate = row 2j, up = row 2j + 1. Checkpoints
that store each expert apart (Qwen3-MoE, Mixtral, DeepSeek-V3) or gate and up as halves (GGUF's
ffn_*_exps) are stacked and interleaved while loading (gpu/loader/experts.py), so one layout,
one tensor-parallel cut and one kernel serve every family.

On CUDA the experts run through a fused Triton grouped GEMM instead (`_fused_forward`, two
launches): gpu/kernels/triton/moe_gemm.py for experts in the model dtype, mxfp4_moe.py for
packed ones; both fuse the gather, the bias, the (clamped) SwiGLU, the router weight and the
scatter back to (token, slot) order (their shared epilogue: moe_common.py). Packed experts
(PackedExperts: MXFP4 blocks and scales as the checkpoint stores them, about a quarter of
bf16's bytes) are decoded inside the kernel; without it (CPU), they are dequantised on every
call and run as above: a fallback for tests and tools, not for serving.

Tensor parallelism (gpu/parallel.py) is tensor-parallel experts, as vLLM's default for
gpt-oss: every rank holds every expert, but only its slice of each expert's intermediate
dimension (gate_up's rows, down's columns; expert_columns). A slice that does not come out
even (or, packed, to whole 32-column MXFP4 scale groups) is padded with zero columns: a zero
gate and up give a zero SwiGLU, so the padding adds nothing (as vLLM pads gpt-oss's 2880 for
MXFP4 at TP 4). The router is
replicated, so every rank routes every token alike; each rank's down projection gives a
partial sum, the down bias is added by rank 0 alone (the loader zeros it elsewhere), and one
all-reduce per layer (gpu/models/causal_lm.py DecoderLayer) sums them. A shared expert is cut
as a dense MLP is (its gate, when it has one, replicated) and joins the same partial sum.
Expert parallelism (whole experts per rank) would need an all-to-all and would leave ranks
idle when routing is uneven (docs/scaling.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.quantization import mxfp4
from gpu.config.model import ModelConfig
from gpu.config.moe import MoESpec
from gpu.parallel import SINGLE, TP
from gpu.layers.ops import skip_init


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] interleaved (gate, up) -> [N, I]: (clamp(up, ±limit) + 1) * g * sigmoid(alpha g),
    g = min(gate, limit)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] interleaved (gate, up) -> [N, I]: silu(gate) * up."""
    return F.silu(gate_up[..., ::2]) * gate_up[..., 1::2]


GPT_OSS = MoESpec()


def route(router_logits: torch.Tensor, top_k: int, spec: MoESpec = GPT_OSS,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] fp32, experts [T, k]) by spec's strategy (module doc).
    correction [E]: DeepSeek-V3's e_score_correction_bias, added for the choice only."""
    logits = router_logits.float()
    if spec.scoring == "softmax":
        if spec.norm_topk_prob:   # softmax over all, top k, renormalised = softmax over the top k
            top, experts = logits.topk(top_k, dim=-1)
            return top.softmax(dim=-1), experts
        return logits.softmax(dim=-1).topk(top_k, dim=-1)
    scores = logits.sigmoid()                                                   # [T, E]
    choice = scores if correction is None else scores + correction.float()
    if spec.n_group > 1:      # keep the topk_group groups whose two best choices sum highest
        T, E = choice.shape
        grouped = choice.view(T, spec.n_group, E // spec.n_group)               # [T, G, E/G]
        group_score = grouped.topk(min(2, E // spec.n_group), dim=-1).values.sum(-1)   # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(spec.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if spec.norm_topk_prob and not spec.weight_on_input:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, experts


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[e-1]:offs[e]] times w[e]^T for every expert e: a [N, in] sorted by expert,
    w [E, out, in], offs [E] int32 cumulative row counts -> [N, out].

    On CUDA in bf16, torch's grouped GEMM: one kernel for every segment, no host sync (the MoE
    layer runs gpu/kernels/triton/moe_gemm.py there instead, unless Experts.use_kernel is off).
    Elsewhere the segment lengths are read on the host: when padding every segment to the
    longest at most doubles the rows (many tokens, balanced routing), one padded batched
    matmul; else (decode: a few experts hit) one matmul per non-empty segment, which reads
    only the routed experts' weights. torch's CPU grouped_mm is not used: it ran several
    times slower than a plain matmul of the same FLOPs (scripts/bench_moe.py).
    """
    if a.device.type == "cuda" and a.dtype == torch.bfloat16:
        return F.grouped_mm(a, w.transpose(1, 2), offs=offs)
    longest = int(torch.diff(offs, prepend=offs.new_zeros(1)).max()) if a.shape[0] else 0
    if longest * w.shape[0] <= 2 * a.shape[0]:
        return padded_grouped_mm(a, w, offs)
    return segment_mm(a, w, offs)


def segment_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm as one matmul per non-empty segment (reads offs on the host)."""
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], w[e].t(), out=out[start:end])
        start = end
    return out


def padded_grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm as one bmm over [E, longest segment, in] (reads offs on the host)."""
    E = w.shape[0]
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    counts = offs.long() - starts
    longest = int(counts.max()) if a.shape[0] else 0
    expert = torch.repeat_interleave(torch.arange(E, device=a.device), counts)     # [N]
    slot = torch.arange(a.shape[0], device=a.device) - starts[expert]               # row within segment
    padded = a.new_zeros(E, max(longest, 1), a.shape[1])
    padded[expert, slot] = a
    out = torch.bmm(padded, w.transpose(1, 2))                                      # [E, longest, out]
    return out[expert, slot]


def run_dense_experts(ex, rows: torch.Tensor, offs: torch.Tensor, by_expert: torch.Tensor, activation) -> torch.Tensor:
    """Expert-sorted rows [N, D] through their experts' gate_up, bias, activation, down and bias
    with grouped_mm (Experts and PackedExperts' run_rows: the weights in the model dtype)."""
    gate_up, down = ex.dense_weights()
    h = grouped_mm(rows, gate_up, offs)                                          # [N, 2I]
    if ex.gate_up_proj_bias is not None:
        h = h + ex.gate_up_proj_bias.index_select(0, by_expert)
    y = grouped_mm(activation(h), down, offs)                                    # [N, D]
    if ex.down_proj_bias is not None:
        y = y + ex.down_proj_bias.index_select(0, by_expert)
    return y


def expert_columns(config: ModelConfig, tp: TP, packed: bool) -> tuple[int, int, int]:
    """This rank's [start, stop) of each expert's intermediate columns, and the width it holds:
    ceil(I / size), rounded up to a multiple of 32 for MXFP4; columns past stop are zero padding
    (the last ranks may hold little or nothing but padding)."""
    I, unit = config.intermediate_size, 32 if packed else 1  # noqa: E741
    if tp.size == 1:
        return 0, I, I
    width = -(-I // (unit * tp.size)) * unit
    start = min(tp.rank * width, I)
    return start, min(start + width, I), width


class MoE(nn.Module):
    """Router plus E experts (plus a shared expert where the config has one); parameters named
    as in gpt-oss's HF checkpoint (mlp.router.*, mlp.experts.*), which the loader maps other
    checkpoints' names to (gpu/loader/experts.py).

    shared: the shared expert, a dense MLP the caller builds (tensor-parallel as any MLP);
    its sigmoid gate, where spec.shared_gate, is built here (shared_expert_gate)."""

    def __init__(self, config: ModelConfig, dtype, device, packed: bool = False, tp: TP = SINGLE,
                 shared: nn.Module | None = None):
        super().__init__()
        c, spec = config, config.moe
        start, stop, width = expert_columns(c, tp, packed)
        E, D = c.num_experts, c.hidden_size
        if packed and (spec.activation != "clamped_swiglu" or not spec.expert_bias or spec.weight_on_input):
            raise ValueError("MXFP4-packed experts are supported with gpt-oss's experts only")
        self.spec = spec
        self.top_k, self.alpha, self.limit = c.num_experts_per_tok, c.swiglu_alpha, c.swiglu_limit
        self.router = skip_init(nn.Linear, D, E, bias=spec.router_bias, dtype=dtype, device=device)
        # DeepSeek-V3 keeps it in fp32: the choice compares sigmoids that differ in the 4th digit
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(E, device=device), requires_grad=False)
                                        if spec.correction_bias else None)
        self.experts = (PackedExperts(E, D, width, dtype, device) if packed
                        else Experts(E, D, width, dtype, device, bias=spec.expert_bias))
        self.shared_expert = shared
        self.shared_expert_gate = (skip_init(nn.Linear, D, 1, bias=False, dtype=dtype, device=device)
                                   if shared is not None and spec.shared_gate else None)
        if width > stop - start:  # padding columns stay zero (zero codes and scales: 0.0 in MXFP4)
            with torch.no_grad():
                for p in self.experts.parameters():
                    p.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] fp32, experts [T, k])."""
        return route(self.router(x), self.top_k, self.spec, self.e_score_correction_bias)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.spec.activation == "swiglu":
            return swiglu(gate_up)
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]; tensor-parallel: this rank's part, which DecoderLayer sums
        over the ranks."""
        T, D = x.shape
        weights, experts = self.route(x)                                       # [T, k] each
        flat = experts.flatten()                                               # [T*k] (token, slot) order
        by_expert, order = flat.sort(stable=True)                              # rows grouped by expert
        offs = torch.searchsorted(by_expert, torch.arange(1, self.experts.num_experts + 1, device=x.device),
                                  out_int32=True)                              # [E] segment ends
        ex = self.experts
        if ex.use_kernel:
            out = self._fused_forward(x, weights, order, offs)
        else:
            rows = x.index_select(0, order // self.top_k)                      # [N, D]
            row_weight = weights.flatten().index_select(0, order).unsqueeze(1)  # [N, 1]
            if self.spec.weight_on_input:
                rows = rows * row_weight.to(rows.dtype)
            y = ex.run_rows(rows, offs, by_expert, self.activation)            # [N, D]
            if not self.spec.weight_on_input:
                y = y * row_weight.to(y.dtype)
            out = torch.empty_like(y).index_copy_(0, order, y)                 # back to (token, slot)
            out = out.view(T, self.top_k, D).sum(1)                            # [T, D]
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return out

    def _fused_forward(self, x, weights, order, offs) -> torch.Tensor:
        """Two launches of the experts' fused grouped GEMM (gpu/kernels/triton/moe_gemm.py, or
        mxfp4_moe.py for packed experts): gather + gate/up + bias + SwiGLU, then down + bias +
        router weight + scatter back to (token, slot) order; the k slots are summed here.
        Llama 4's weight scales the gathered input rows instead."""
        T, D = x.shape
        k, ex = self.top_k, self.experts
        act = True if self.spec.activation == "swiglu" else (self.alpha, self.limit)
        row_weight = weights.flatten().index_select(0, order)                  # [N] fp32
        if self.spec.weight_on_input:
            rows = x.index_select(0, order // k) * row_weight.unsqueeze(1).to(x.dtype)
            h = ex.grouped(0, rows, offs, swiglu=act)                           # [N, I]
            y = ex.grouped(1, h, offs, out_rows=order)                          # [N, D]
        else:
            h = ex.grouped(0, x, offs, a_rows=order // k, swiglu=act)
            y = ex.grouped(1, h, offs, row_scale=row_weight, out_rows=order)
        return y.view(T, k, D).sum(1)                                           # [T, D]


class Experts(nn.Module):
    """The experts in the model dtype. use_kernel: run gpu/kernels/triton/moe_gemm.py's fused
    grouped GEMM (default on CUDA; tests set it on CPU, under the Triton interpreter); else
    grouped_mm above."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype, device, bias: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_kernel = torch.device(device).type == "cuda"
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, **kw))  # [E, 2I, D]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **kw))         # [E, D, I]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate, **kw)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden, **kw)) if bias else None

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj, self.down_proj

    run_rows = run_dense_experts

    def grouped(self, proj: int, a: torch.Tensor, offs: torch.Tensor, **epilogue) -> torch.Tensor:
        """gate_up (proj 0) or down (1) of the routed rows through the fused kernel, with its bias."""
        from gpu.kernels.triton.moe_gemm import moe_gemm
        w, b = (self.gate_up_proj, self.gate_up_proj_bias) if proj == 0 else (self.down_proj, self.down_proj_bias)
        return moe_gemm(a, w, offs, bias=b, **epilogue)


class PackedExperts(nn.Module):
    """The experts as MXFP4, named as the checkpoint names them (NAME_blocks, NAME_scales), with
    the blocks' last two dimensions [K/32, 16] flattened to [K/2]. Biases stay in the model dtype.

    use_kernel: run the Triton grouped GEMM (default on CUDA; tests set it on CPU, under the
    Triton interpreter); else dequantise on each call. dot_scaled: the kernel's tl.dot_scaled
    variant for bf16 models (off until scripts/bench_moe.py --gpu shows it faster)."""

    dot_scaled = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype, device):
        super().__init__()
        if hidden % 32 or intermediate % 32:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes that are multiples of 32, "
                             f"got {hidden} and {intermediate}")
        self.num_experts = num_experts
        self.dtype = dtype
        self.use_kernel = torch.device(device).type == "cuda"
        E, D, I = num_experts, hidden, intermediate  # noqa: E741
        u8 = dict(dtype=torch.uint8, device=device)
        frozen = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731  uint8 cannot need grad
        self.gate_up_proj_blocks = frozen(torch.empty(E, 2 * I, D // 2, **u8))     # [E, 2I, D/2]
        self.gate_up_proj_scales = frozen(torch.empty(E, 2 * I, D // 32, **u8))    # [E, 2I, D/32]
        self.down_proj_blocks = frozen(torch.empty(E, D, I // 2, **u8))            # [E, D, I/2]
        self.down_proj_scales = frozen(torch.empty(E, D, I // 32, **u8))           # [E, D, I/32]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I, dtype=dtype, device=device))
        self.down_proj_bias = nn.Parameter(torch.empty(E, D, dtype=dtype, device=device))

    run_rows = run_dense_experts    # without the kernel: dequantised on every call

    def grouped(self, proj: int, a: torch.Tensor, offs: torch.Tensor, **epilogue) -> torch.Tensor:
        """gate_up (proj 0) or down (1) of the routed rows, decoded inside the kernel."""
        from gpu.kernels.triton.mxfp4_moe import mxfp4_moe_matmul
        name = "gate_up_proj" if proj == 0 else "down_proj"
        blocks, scales, bias = (getattr(self, f"{name}_{part}") for part in ("blocks", "scales", "bias"))
        return mxfp4_moe_matmul(a, blocks, scales, offs, bias=bias, dot_scaled=self.dot_scaled and a.dtype == torch.bfloat16,
                                **epilogue)

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (mxfp4.dequantize_packed(self.gate_up_proj_blocks, self.gate_up_proj_scales, self.dtype),
                mxfp4.dequantize_packed(self.down_proj_blocks, self.down_proj_scales, self.dtype))


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Dense reference: every expert on every token in fp32, weighted by a [T, E] routing
    matrix that is zero outside each token's top k (Llama 4's: the weight scales the input)."""
    xf = x.float()
    weights, experts = moe.route(x)
    dense = torch.zeros(x.shape[0], moe.experts.num_experts, device=x.device).scatter_(1, experts, weights)  # [T, E]
    ex = moe.experts
    gate_up, down = (w.float() for w in ex.dense_weights())
    if moe.spec.weight_on_input:
        h = torch.einsum("td,te,eod->teo", xf, dense, gate_up)
    else:
        h = torch.einsum("td,eod->teo", xf, gate_up)
    if ex.gate_up_proj_bias is not None:
        h = h + ex.gate_up_proj_bias.float()
    h = moe.activation(h)                                                       # [T, E, I]
    y = torch.einsum("tei,edi->ted", h, down)
    if ex.down_proj_bias is not None:
        y = y + ex.down_proj_bias.float()
    if moe.spec.weight_on_input:    # unrouted experts: zero input, and without biases zero output
        out = torch.einsum("te,ted->td", (dense != 0).float(), y)
    else:
        out = torch.einsum("te,ted->td", dense, y)
    if moe.shared_expert is not None:
        shared = moe.shared_expert(x).float()
        if moe.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(moe.shared_expert_gate(x).float())
        out = out + shared
    return out.to(x.dtype)
