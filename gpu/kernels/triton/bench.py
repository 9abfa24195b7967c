"""Kernel micro-benchmarks at model-sized shapes (Qwen3-0.6B, then SmolLM2-135M), apart
from the tests.

    python3 -m gpu.kernels.triton.bench --out results/kernels_bench.json [--model qwen3-0.6b]

Times each kernel against its torch reference (or a torch baseline) with CUDA
events, after a warm-up that also triggers compilation, and reports the bytes each
kernel must move at the least (its inputs read once, its outputs written once) over its
time: achieved GB/s, and that as a fraction of the H200's 4.8 TB/s (HBM3e). These
kernels are memory-bound at decode sizes, so the fraction is how far each is from its
ceiling. On a machine without CUDA it runs tiny shapes once under the interpreter (a
smoke test of this file).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu.kernels.triton.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from gpu.kernels.triton.kv_cache import write_kv  # noqa: E402
from gpu.kernels.triton.paged_attention import paged_attention  # noqa: E402
from gpu.kernels.triton.qkv_prep import prepare_qkv  # noqa: E402
from gpu.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_ref  # noqa: E402
from gpu.kernels.triton.rope import apply_rope  # noqa: E402
from gpu.kernels.triton.sampling import apply_penalties, sample  # noqa: E402


def _time_ms(fn, iters: int) -> float:
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _attention_inputs(batch, q_len, ctx, hq, hkv, dh, page, dtype, device):
    pages = -(-ctx // page)
    k_cache = torch.randn(batch * pages, page, hkv, dh, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * pages, device=device).view(batch, pages).int()
    cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch * q_len, hq, dh, device=device, dtype=dtype)
    return q, k_cache, v_cache, tables, cu, seq_lens


PEAK_GBPS = 4800.0   # H200 HBM3e

# (q heads, kv heads, head_dim, hidden, intermediate, vocab)
MODELS = {
    "qwen3-0.6b": (16, 8, 128, 1024, 3072, 151936),
    "smollm2-135m": (9, 3, 64, 576, 1536, 49152),
}


def run(quick: bool, model: str = "qwen3-0.6b") -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    iters = 20
    hq, hkv, dh, hidden, inter, vocab = MODELS[model]
    if quick:
        vocab, hidden, inter = 512, 72, 96
    results = []

    def record(name, shape, fn, baseline=None, nbytes=None):
        ms = _time_ms(fn, iters)
        row = dict(model=model, kernel=name, shape=shape, dtype=str(dtype), ms=round(ms, 4))
        if baseline is not None:
            row["torch_ms"] = round(_time_ms(baseline, iters), 4)
        if nbytes:
            gbps = nbytes / (ms * 1e-3) / 1e9
            row.update(mbytes=round(nbytes / 1e6, 3), gbps=round(gbps, 1),
                       of_peak=round(gbps / PEAK_GBPS, 3))
        results.append(row)
        print(json.dumps(row), flush=True)

    # Decode attention is the step's largest memory stream: its GB/s against 4.8 TB/s is
    # the figure to watch. Two KV layouts, the same kernel (it takes any strides): today's
    # [blocks, block_size, Hkv, Dh] ("NHD": a head's 16 positions of a page are 16 runs of
    # Dh) against [blocks, Hkv, block_size, Dh] ("HND": one contiguous run per head and
    # page), passed as its transposed view. Keep the faster one (gpu/attention.KVCache).
    decode_cases = [(1, 128)] if quick else [(1, 1024), (8, 4096), (64, 1024), (256, 840), (256, 2048)]
    from gpu.kernels.triton.paged_attention import suggest_num_kv_splits
    for batch, ctx in decode_cases:
        args = _attention_inputs(batch, 1, ctx, hq, hkv, dh, 16, dtype, device)
        q, kc, vc, *meta = args
        head_major = (kc.transpose(1, 2).contiguous().transpose(1, 2),
                      vc.transpose(1, 2).contiguous().transpose(1, 2))
        kv_bytes = 2 * batch * ctx * hkv * dh * elem + 2 * batch * hq * dh * elem
        splits = suggest_num_kv_splits(batch, hkv, ctx, torch.device(device))
        for layout, (k_, v_) in (("NHD", (kc, vc)), ("HND", head_major)):
            for n in sorted({1, splits}):   # as eager runs it, and as the captured graph does
                record("paged_attention_decode", dict(batch=batch, ctx=ctx, splits=n, layout=layout),
                       lambda k_=k_, v_=v_, n=n: paged_attention(q, k_, v_, *meta, dh ** -0.5,
                                                                 max_seqlen_q=1, num_kv_splits=n),
                       nbytes=kv_bytes)
    prefill_cases = [(1, 32)] if quick else [(1, 2048), (8, 512)]
    for batch, q_len in prefill_cases:
        args = _attention_inputs(batch, q_len, q_len, hq, hkv, dh, 16, dtype, device)
        q = args[0].view(batch, q_len, hq, dh).transpose(1, 2)
        k = torch.randn(batch, hq, q_len, dh, device=device, dtype=dtype)
        record("paged_attention_prefill", dict(batch=batch, q_len=q_len),
               lambda: paged_attention(*args, dh ** -0.5, max_seqlen_q=q_len),
               lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True),
               nbytes=batch * q_len * (2 * hq + 2 * hkv) * dh * elem)

    n = 8 if quick else 4096
    x = torch.randn(n, hidden, device=device, dtype=dtype)
    w = torch.ones(hidden, device=device, dtype=dtype)
    record("fused_add_rms_norm", dict(n=n, d=hidden), lambda: fused_add_rms_norm(x, x, w, 1e-6),
           lambda: rms_norm_ref(x + x, w, 1e-6), nbytes=4 * n * hidden * elem)
    gate_up = torch.randn(n, 2 * inter, device=device, dtype=dtype)
    record("silu_and_mul", dict(n=n, i=inter), lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up),
           nbytes=3 * n * inter * elem)
    qr = torch.randn(n, hq, dh, device=device, dtype=dtype)
    kr = torch.randn(n, hkv, dh, device=device, dtype=dtype)
    cos_sin = torch.randn(8192, dh, device=device)
    pos = torch.randint(0, 8192, (n,), device=device)
    record("apply_rope", dict(t=n, hq=hq, hkv=hkv), lambda: apply_rope(qr, kr, pos, cos_sin),
           nbytes=2 * n * (hq + hkv) * dh * elem + n * dh * 4)
    kc = torch.empty(-(-n // 16) + 1, 16, hkv, dh, device=device, dtype=dtype)
    slots = torch.randperm(kc.shape[0] * 16, device=device)[:n]
    record("write_kv", dict(t=n), lambda: write_kv(kr, kr, kc, kc, slots), nbytes=4 * n * hkv * dh * elem)
    # the fused per-layer kernel against the unfused chain it replaces (2 norms, rope, write)
    for t in ((4,) if quick else (256, 4096)):
        qkv = torch.randn(t, (hq + 2 * hkv) * dh, device=device, dtype=dtype)
        wn = torch.ones(dh, device=device, dtype=dtype)
        kc = torch.empty(-(-t // 16) + 1, 16, hkv, dh, device=device, dtype=dtype)
        sl = torch.randperm(kc.shape[0] * 16, device=device)[:t]
        ps = torch.randint(0, 8192, (t,), device=device)

        def unfused(qkv=qkv, wn=wn, sl=sl, ps=ps, kc=kc):
            q, k, v = qkv.split([hq * dh, hkv * dh, hkv * dh], dim=-1)
            qn = rms_norm(q.reshape(-1, dh), wn, 1e-6).view(-1, hq, dh)
            kn = rms_norm(k.reshape(-1, dh), wn, 1e-6).view(-1, hkv, dh)
            qn, kn = apply_rope(qn, kn, ps, cos_sin)
            write_kv(kn, v.view(-1, hkv, dh), kc, kc, sl)

        record("prepare_qkv", dict(t=t, hq=hq, hkv=hkv),
               lambda qkv=qkv, wn=wn, sl=sl, ps=ps, kc=kc: prepare_qkv(qkv, hq, hkv, dh, wn, wn, 1e-6, ps, cos_sin,
                                                               kc, kc, sl),
               unfused, nbytes=t * (2 * hq + 4 * hkv) * dh * elem)

    b = 4 if quick else 256
    logits = torch.randn(b, vocab, device=device)
    f32 = lambda v: torch.full((b,), v, device=device)  # noqa: E731
    params = dict(temperature=f32(0.8), top_k=torch.full((b,), 50, device=device, dtype=torch.int32),
                  top_p=f32(0.9), min_p=f32(0.05), seeds=torch.arange(b, device=device),
                  steps=torch.zeros(b, device=device, dtype=torch.int64))
    record("sample_top_k_top_p", dict(b=b, v=vocab), lambda: sample(logits, **params),
           lambda: torch.multinomial(torch.softmax(logits, -1), 1), nbytes=b * vocab * 4)
    record("sample_plain", dict(b=b, v=vocab), lambda: sample(logits, **params, use_top_k_top_p=False,
                                                              use_min_p=False), nbytes=b * vocab * 4)
    if not quick:  # a small batch: the vocabulary split over the grid is what fills the GPU here
        small = {k: v[:4] for k, v in params.items()}
        record("sample_plain", dict(b=4, v=vocab), lambda: sample(logits[:4], **small, use_top_k_top_p=False,
                                                                  use_min_p=False), nbytes=4 * vocab * 4)
    mask = torch.zeros(b, vocab, device=device, dtype=torch.bool)
    counts = torch.zeros(b, vocab, device=device, dtype=torch.int32)
    record("apply_penalties", dict(b=b, v=vocab),
           lambda: apply_penalties(logits, mask, counts, f32(1.1), f32(0.1), f32(0.1)), nbytes=13 * b * vocab)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (default without CUDA)")
    parser.add_argument("--model", choices=sorted(MODELS), action="append",
                        help="model shapes to run (repeatable; default: Qwen3-0.6B, then SmolLM2-135M "
                             "on CUDA, one tiny set without)")
    args = parser.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    models = args.model or (["qwen3-0.6b"] if quick else ["qwen3-0.6b", "smollm2-135m"])
    results = [row for m in models for row in run(quick=quick, model=m)]
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            import triton
            json.dump(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           torch=torch.__version__, triton=triton.__version__, peak_gbps=PEAK_GBPS,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
