"""Token sampling and logit penalties on the device, without a host sync.

sample(logits [B, V] fp32/bf16/fp16, temperature [B] f32, top_k [B] i32, top_p [B] f32,
       min_p [B] f32, seeds [B] i64, steps [B] i64) -> [B] int64

    temperature 0 = greedy (argmax of the raw logits, first index on ties);
    top_k <= 0, top_p >= 1, min_p <= 0 turn the filter off.
    Filters, in the order vLLM applies them: top-k, then top-p on the
    renormalized top-k distribution, then min-p (p >= min_p * p_max).  Tokens
    tied with the top-k / top-p boundary logit are kept.

    The draw is a Gumbel-max race over the allowed tokens:
        token = argmax_v  logit_v / T - log(-log(u_v))
    which samples exactly softmax(logit / T) restricted to the allowed set.
    u_v = output v % 4 of philox(key=seed, counter=(v // 4, step_lo, step_hi, 0))
    (all four outputs of a call are used), so the random stream of a request
    depends only on (seed, step, vocab index): the same seed and step give the
    same token whatever else is in the batch.

    The logits may be fp32, bf16 or fp16: the kernel converts each tile on load, so a
    bf16 model's [B, V] logits are never copied to fp32 whole.

    Top-k / top-p need an order statistic: it is computed in torch on the device
    (one sort of the rows) as a per-row cutoff logit; the Triton kernel applies
    the cutoff and min-p, and runs the race.  A caller that knows no request
    uses top-k / top-p passes use_top_k_top_p=False to skip the sort, and one
    that knows none uses min-p passes use_min_p=False to skip the row max.
    The vocabulary is split over the grid's second axis (a small batch still
    fills the GPU); a small reduction picks each row's best chunk.

apply_penalties(logits [B, V] f32, prompt_mask [B, V] bool, output_counts [B, V] i32,
                repetition_penalty [B] f32, frequency_penalty [B] f32,
                presence_penalty [B] f32) -> [B, V] f32 (new tensor)

    Dense count layout: output_counts[b, v] = times v occurs in b's generated
    tokens; prompt_mask[b, v] = v occurs in b's prompt (build_token_counts
    makes either from padded token-id rows).  Then, per token:
        seen  = prompt_mask | (output_counts > 0)
        l     = seen ? (l > 0 ? l / rep : l * rep) : l          (HF repetition)
        l    -= freq * count + pres * (count > 0)               (OpenAI)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# --------------------------------------------------------------------------- sampling


@triton.jit(do_not_specialize=["n_rows"])
def _sample_kernel(
    logits_ptr, key_out_ptr, idx_out_ptr, temperature_ptr, threshold_ptr, seeds_ptr, steps_ptr,
    n_rows, vocab, stride_l, n_chunks,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (row block, vocab chunk): the Gumbel-max race over its CHUNK columns; writes
    its best key and index per row to [n_rows, n_chunks], which _reduce_chunks merges."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    chunk = tl.program_id(1)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    temp = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    threshold = tl.load(threshold_ptr + rows, mask=row_mask, other=float("-inf")).to(tl.float32)
    seed = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
    step = tl.load(steps_ptr + rows, mask=row_mask, other=0)
    random = temp > 0.0
    inv_t = tl.where(random, 1.0 / tl.where(random, temp, 1.0), 1.0)

    # one philox call gives four 32-bit outputs: a quarter as many calls as columns (philox's
    # ten rounds, not the load, bound this kernel at a large vocabulary)
    seed_2d = tl.broadcast_to(seed[:, None], [BLOCK_B, BLOCK_V // 4])
    step_lo = tl.broadcast_to((step & 0xFFFFFFFF).to(tl.uint32)[:, None], [BLOCK_B, BLOCK_V // 4])
    step_hi = tl.broadcast_to(((step >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None], [BLOCK_B, BLOCK_V // 4])
    zero = tl.zeros([BLOCK_B, BLOCK_V // 4], dtype=tl.uint32)
    best_key = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK_B], dtype=tl.int32) + chunk * CHUNK
    for offset in range(0, CHUNK, BLOCK_V):
        start = chunk * CHUNK + offset
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < vocab)[None, :]
        l = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :], mask=mask, other=float("-inf"))
        l = l.to(tl.float32)
        quads = start // 4 + tl.arange(0, BLOCK_V // 4)  # column v takes output v % 4 of counter v // 4
        counter = tl.broadcast_to(quads[None, :], [BLOCK_B, BLOCK_V // 4]).to(tl.uint32)
        r0, r1, r2, r3 = tl.philox(seed_2d, counter, step_lo, step_hi, zero)
        r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK_B, BLOCK_V])
        u = ((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # in (0, 1)
        gumbel = -tl.log(-tl.log(u))
        key = l * inv_t[:, None] + tl.where(random[:, None], gumbel, 0.0)
        key = tl.where(mask & (l >= threshold[:, None]), key, float("-inf"))
        blk_key = tl.max(key, 1)
        blk_idx = tl.argmax(key, 1).to(tl.int32) + start
        better = blk_key > best_key  # strict: the first index wins a tie
        best_idx = tl.where(better, blk_idx, best_idx)
        best_key = tl.where(better, blk_key, best_key)
    out = rows64 * n_chunks + chunk
    tl.store(key_out_ptr + out, best_key, mask=row_mask)
    tl.store(idx_out_ptr + out, best_idx.to(tl.int64), mask=row_mask)


def _pick_sample_blocks(vocab: int) -> dict:
    """From the vocabulary alone (never the batch size): one compiled variant per model.
    The vocabulary is split into chunks of CHUNK columns along the grid's second axis, so a
    small batch still fills the GPU (B=1 over Qwen3's 151,936 columns: 75 programs)."""
    block_v = max(4, min(1024, triton.next_power_of_2(vocab)))   # 4 columns per philox call
    chunk = min(2 * block_v, triton.next_power_of_2(vocab))
    block_b = max(1, min(256, 2048 // block_v))
    return dict(CHUNK=chunk, BLOCK_B=block_b, BLOCK_V=block_v, num_warps=4 if block_b * block_v <= 1024 else 8)


def _top_k_top_p_cutoff(logits, temperature, top_k, top_p):
    """Per-row smallest allowed logit under top-k then top-p ([B] f32, on the device)."""
    B, V = logits.shape
    sorted_l = logits.sort(dim=-1, descending=True).values
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).long()
    rank = torch.arange(V, device=logits.device)
    in_k = rank[None, :] < k[:, None]
    probs = torch.softmax(sorted_l / t[:, None], dim=-1) * in_k
    probs = probs / probs.sum(-1, keepdim=True)
    mass_before = probs.cumsum(-1) - probs
    keep = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = keep.sum(-1).clamp(min=1)
    return sorted_l.gather(1, (n_keep - 1)[:, None]).squeeze(1).float().contiguous()


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    use_top_k_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    B, V = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1, \
        "logits must be float [B, V] with contiguous rows"
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                        ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                        ("seeds", seeds, torch.int64), ("steps", steps, torch.int64)):
        assert t.shape == (B,) and t.dtype == dt and t.is_contiguous(), f"{name}: want [B] {dt}, got {tuple(t.shape)} {t.dtype}"
    if B == 0:
        return torch.empty(B, dtype=torch.int64, device=logits.device)
    if use_top_k_top_p:
        threshold = _top_k_top_p_cutoff(logits, temperature, top_k, top_p)
    else:
        threshold = torch.full((B,), float("-inf"), dtype=torch.float32, device=logits.device)
    if use_min_p:  # p >= min_p * p_max  <=>  l >= l_max + T log(min_p)
        on = (temperature > 0) & (min_p > 0)
        by_min_p = logits.amax(dim=-1) + temperature * torch.log(min_p.clamp_min(1e-30))
        threshold = torch.where(on, torch.maximum(threshold, by_min_p), threshold)
    cfg = _pick_sample_blocks(V)
    n_chunks = triton.cdiv(V, cfg["CHUNK"])
    keys = torch.empty((B, n_chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((B, n_chunks), dtype=torch.int64, device=logits.device)
    grid = (triton.cdiv(B, cfg["BLOCK_B"]), n_chunks)
    _sample_kernel[grid](logits, keys, idx, temperature, threshold.contiguous(), seeds, steps,
                         B, V, logits.stride(0), n_chunks, **cfg)
    if n_chunks == 1:
        return idx[:, 0]
    # the small reduction: each row's best chunk (argmax keeps the first, lowest-index, on ties)
    return idx.gather(1, keys.argmax(dim=1, keepdim=True))[:, 0]


def sampling_mask_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """[B, V] bool: the tokens a request may sample (greedy rows: the argmax only)."""
    B, V = logits.shape
    mask = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    for b in range(B):
        l = logits[b].double()
        if temperature[b] <= 0:
            mask[b, l.argmax()] = True
            continue
        allowed = torch.ones(V, dtype=torch.bool, device=logits.device)
        k = int(top_k[b])
        if 0 < k < V:
            allowed &= l >= torch.topk(l, k).values[-1]
        probs = torch.softmax(l / float(temperature[b]), -1)
        if float(top_p[b]) < 1.0:
            p = torch.where(allowed, probs, 0.0)
            p = p / p.sum()
            order = torch.argsort(p, descending=True)
            before = torch.cumsum(p[order], 0) - p[order]
            kept = order[before < float(top_p[b])]
            allowed &= l >= l[kept].min()
        if float(min_p[b]) > 0.0:
            allowed &= probs >= float(min_p[b]) * probs.max()
        mask[b] = allowed
    return mask


def sampling_probs_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """[B, V] f32: the distribution sample() draws from."""
    allowed = sampling_mask_ref(logits, temperature, top_k, top_p, min_p)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = (logits.double() / t[:, None].double()).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scaled, -1).float()


# --------------------------------------------------------------------------- penalties


@triton.jit(do_not_specialize=["n_rows"])
def _penalties_kernel(
    logits_ptr, out_ptr, prompt_mask_ptr, counts_ptr,
    rep_ptr, freq_ptr, pres_ptr,
    n_rows, vocab,
    stride_l, stride_o, stride_pm, stride_c,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < vocab)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    rep = tl.load(rep_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)[:, None]
    freq = tl.load(freq_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    pres = tl.load(pres_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]

    l = tl.load(logits_ptr + rows64 * stride_l + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    in_prompt = tl.load(prompt_mask_ptr + rows64 * stride_pm + cols[None, :], mask=mask, other=0) != 0
    count = tl.load(counts_ptr + rows64 * stride_c + cols[None, :], mask=mask, other=0)
    in_output = count > 0
    seen = in_prompt | in_output
    l = tl.where(seen, tl.where(l > 0.0, l / rep, l * rep), l)
    l = l - freq * count.to(tl.float32) - tl.where(in_output, pres, 0.0)
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], l, mask=mask)


def _pick_penalty_blocks(n_rows: int, vocab: int) -> dict:
    block_v = max(4, min(1024, triton.next_power_of_2(vocab)))   # 4 columns per philox call
    block_b = max(1, min(64, 4096 // block_v))  # not from n_rows: one variant per model
    return dict(BLOCK_B=block_b, BLOCK_V=block_v, num_warps=4)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    B, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert prompt_mask.shape == (B, V) and prompt_mask.dtype == torch.bool and prompt_mask.stride(1) == 1
    assert output_counts.shape == (B, V) and output_counts.dtype == torch.int32 and output_counts.stride(1) == 1
    for t in (repetition_penalty, frequency_penalty, presence_penalty):
        assert t.shape == (B,) and t.dtype == torch.float32 and t.is_contiguous()
    out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    if B == 0:
        return out
    cfg = _pick_penalty_blocks(B, V)
    grid = (triton.cdiv(B, cfg["BLOCK_B"]), triton.cdiv(V, cfg["BLOCK_V"]))
    _penalties_kernel[grid](
        logits, out, prompt_mask.view(torch.uint8), output_counts,
        repetition_penalty, frequency_penalty, presence_penalty,
        B, V,
        logits.stride(0), out.stride(0), prompt_mask.stride(0), output_counts.stride(0),
        **cfg,
    )
    return out


def apply_penalties_ref(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    rep = repetition_penalty[:, None]
    seen = prompt_mask | (output_counts > 0)
    l = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    l = l - frequency_penalty[:, None] * output_counts.float()
    return l - presence_penalty[:, None] * (output_counts > 0).float()


def build_token_counts(token_ids: torch.Tensor, vocab: int, pad_id: int = -1) -> torch.Tensor:
    """[B, L] int64 token ids (pad_id = padding) -> [B, V] int32 occurrence counts, on the device."""
    B = token_ids.shape[0]
    counts = torch.zeros((B, vocab + 1), dtype=torch.int32, device=token_ids.device)
    idx = torch.where(token_ids == pad_id, vocab, token_ids)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab].contiguous()
