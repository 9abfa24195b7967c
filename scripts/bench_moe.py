"""CPU time of one gpt-oss MoE layer: gpu/layers/moe.py as it runs on CPU ("ours": padded bmm or one
matmul per expert segment, by the routing), each of those alone, torch's grouped_mm (its CUDA
bf16 path) and transformers' GptOssExperts loop (one expert at a time, gathering the tokens routed to it),
on the same weights and routing. Interleaved, best of N, so that a busy
machine hurts all alike.

    .venv/bin/python scripts/bench_moe.py --hidden 512 --experts 32 --top-k 4 --tokens 1 16 256

With --gpu (CUDA): the MXFP4 grouped GEMM against torch's bf16 grouped GEMM at gpt-oss-20b
shapes instead (--hidden 2880, the default with --gpu): ms of the experts (gate/up, SwiGLU,
down, router weight, the k-slot sum; router and sort excluded, the same for both), the
speed-up, the same kernel with tl.dot_scaled on the packed operand (gpu/layers/moe.py uses it
when PackedExperts.dot_scaled is set: keep the faster), and the packed bytes the kernel
reads (the experts hit) over its time against the H200's 4.8 TB/s; it also checks that all
agree (bf16 tolerance). Goals (issue 27): >= 2x
the bf16 time at decode batch 1-32, prefill no more than 1.25x slower, >= 50% of 4.8 TB/s.

    python scripts/bench_moe.py --gpu --tokens 1 2 4 8 16 32 512 2048 --out moe.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from gpu.layers import moe as moe_mod
from gpu.config.model import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=None, help="default 512; 2880 (gpt-oss) with --gpu")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--gpu", action="store_true", help="MXFP4 kernel vs bf16 grouped GEMM on CUDA")
    ap.add_argument("--out", default=None, help="--gpu: write the figures here (JSON)")
    a = ap.parse_args()
    if a.gpu:
        h = a.hidden or 2880
        gpu_run(a.tokens, experts=a.experts, top_k=a.top_k, hidden=h, inter=h, out=a.out)
        return
    a.hidden = a.hidden or 512
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    dt = getattr(torch, a.dtype)
    h = a.hidden
    config = ModelConfig(architecture="gpt_oss", vocab_size=8, hidden_size=h, intermediate_size=h,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=h,
                         rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=8,
                         num_experts=a.experts, num_experts_per_tok=a.top_k)
    layer = moe_mod.MoE(config, dt, "cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    hf = GptOssExperts(transformers.GptOssConfig(hidden_size=h, intermediate_size=h, num_local_experts=a.experts))
    hf.to(dt)
    ex = layer.experts
    with torch.no_grad():  # the same weights in transformers' [E, in, out] layout
        hf.gate_up_proj.copy_(ex.gate_up_proj.transpose(1, 2))
        hf.down_proj.copy_(ex.down_proj.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(ex.gate_up_proj_bias)
        hf.down_proj_bias.copy_(ex.down_proj_bias)

    print(f"hidden {h}, {a.experts} experts top-{a.top_k}, {a.dtype}, {torch.get_num_threads()} threads; "
          "ms per layer (best of {a.repeats})".replace("{a.repeats}", str(a.repeats)))
    print(f"{'tokens':>7s} {'ours':>7s} {'segments':>9s} {'grouped_mm':>11s} {'padded bmm':>11s} {'HF loop':>9s}")
    for t in a.tokens:
        x = torch.randn(t, h).to(dt)

        def hf_run():
            weights, experts = moe_mod.route(layer.router(x), layer.top_k)
            return hf(x, experts, weights)

        def with_mm(impl):
            def run():
                saved = moe_mod.grouped_mm
                moe_mod.grouped_mm = impl
                try:
                    return layer(x)
                finally:
                    moe_mod.grouped_mm = saved
            return run

        torch_grouped = lambda a_, w_, o_: F.grouped_mm(a_, w_.transpose(1, 2), offs=o_)  # noqa: E731
        runs = {"ours": lambda: layer(x), "segments": with_mm(moe_mod.segment_mm),
                "grouped": with_mm(torch_grouped), "padded": with_mm(moe_mod.padded_grouped_mm), "hf": hf_run}
        with torch.inference_mode():
            ref = runs["hf"]().float()
            for f in runs.values():
                assert torch.allclose(f().float(), ref, atol=1e-2, rtol=1e-2)
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(a.repeats):
                for key, f in runs.items():
                    t0 = time.perf_counter()
                    f()
                    best[key] = min(best[key], time.perf_counter() - t0)
        print(f"{t:>7d} {best['ours'] * 1e3:>7.2f} {best['segments'] * 1e3:>9.2f} {best['grouped'] * 1e3:>11.2f} "
              f"{best['padded'] * 1e3:>11.2f} {best['hf'] * 1e3:>9.2f}")


HBM_BYTES_S = 4.8e12


def gpu_run(tokens_list, experts=32, top_k=4, hidden=2880, inter=2880, out=None) -> list[dict]:
    """On CPU (a smoke test of this script, e.g. --hidden 64): the kernel under the Triton
    interpreter, wall-clock timing; the figures mean nothing there."""
    import os

    if not torch.cuda.is_available():   # before the kernel module is imported (triton.jit reads it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from gpu.quantization import mxfp4
    from gpu.kernels.triton.mxfp4_moe import mxfp4_moe_matmul
    from gpu.layers.moe import clamped_swiglu

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        import triton.testing
        bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100) / 1e3  # noqa: E731
    else:
        def bench(f):
            t0 = time.perf_counter()
            f()
            return time.perf_counter() - t0
    g = torch.Generator(device=dev).manual_seed(0)
    E, D, I = experts, hidden, inter  # noqa: E741
    gu_blocks = torch.randint(0, 256, (E, 2 * I, D // 2), device=dev, dtype=torch.uint8, generator=g)
    gu_scales = torch.full((E, 2 * I, D // 32), 119, device=dev, dtype=torch.uint8)
    dn_blocks = torch.randint(0, 256, (E, D, I // 2), device=dev, dtype=torch.uint8, generator=g)
    dn_scales = torch.full((E, D, I // 32), 119, device=dev, dtype=torch.uint8)
    gu_bias = torch.randn(E, 2 * I, device=dev, generator=g).bfloat16() * 0.1
    dn_bias = torch.randn(E, D, device=dev, generator=g).bfloat16() * 0.1
    gu_dense = mxfp4.dequantize_packed(gu_blocks, gu_scales, torch.bfloat16)
    dn_dense = mxfp4.dequantize_packed(dn_blocks, dn_scales, torch.bfloat16)
    per_expert = (gu_blocks[0].numel() + gu_scales[0].numel() + dn_blocks[0].numel() + dn_scales[0].numel())
    results = []
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU, Triton interpreter (smoke test only)"
    print(f"gpt-oss MoE experts, {E} experts top-{top_k}, D=I={D}, bf16, {name}")
    print(f"{'tokens':>7s} {'bf16 ms':>8s} {'mxfp4 ms':>9s} {'dot_scaled':>11s} {'speed-up':>9s} {'experts hit':>12s} "
          f"{'GB/s':>7s} {'of HBM':>7s}")
    for T in tokens_list:
        x = torch.randn(T, D, device=dev, generator=g).bfloat16()
        logits = torch.randn(T, E, device=dev, generator=g)
        top, ex = logits.topk(top_k, dim=-1)
        weights = top.softmax(-1)
        by_expert, order = ex.flatten().sort(stable=True)
        offs = torch.searchsorted(by_expert, torch.arange(1, E + 1, device=dev), out_int32=True)
        w_sorted = weights.flatten().index_select(0, order)

        def packed(scaled=False):
            h = mxfp4_moe_matmul(x, gu_blocks, gu_scales, offs, bias=gu_bias, a_rows=order // top_k,
                                 swiglu=(1.702, 7.0), dot_scaled=scaled)
            y = mxfp4_moe_matmul(h, dn_blocks, dn_scales, offs, bias=dn_bias, row_scale=w_sorted, out_rows=order,
                                 dot_scaled=scaled)
            return y.view(T, top_k, D).sum(1)

        def dense():
            rows = x.index_select(0, order // top_k)
            h = F.grouped_mm(rows, gu_dense.transpose(1, 2), offs=offs) + gu_bias.index_select(0, by_expert)
            h = clamped_swiglu(h, 1.702, 7.0)
            y = F.grouped_mm(h, dn_dense.transpose(1, 2), offs=offs) + dn_bias.index_select(0, by_expert)
            y = y * w_sorted.unsqueeze(1).to(y.dtype)
            return torch.empty_like(y).index_copy_(0, order, y).view(T, top_k, D).sum(1)

        a, b, c = packed().float(), dense().float(), packed(True).float()
        err = max(((a - b).norm() / b.norm()).item(), ((c - b).norm() / b.norm()).item())
        t_dense, t_packed, t_scaled = bench(dense), bench(packed), bench(lambda: packed(True))
        hit = int(by_expert.unique().numel())
        gbs = hit * per_expert / t_packed / 1e9
        row = dict(tokens=T, bf16_ms=t_dense * 1e3, mxfp4_ms=t_packed * 1e3, dot_scaled_ms=t_scaled * 1e3,
                   speedup=t_dense / t_packed,
                   experts_hit=hit, packed_gb_s=gbs, hbm_fraction=gbs * 1e9 / HBM_BYTES_S, rel_err=err)
        results.append(row)
        print(f"{T:>7d} {row['bf16_ms']:8.3f} {row['mxfp4_ms']:9.3f} {t_scaled * 1e3:11.3f} {row['speedup']:8.2f}x "
              f"{hit:>12d} {gbs:7.0f} {row['hbm_fraction']:6.0%}  (rel err {err:.1e})")
        assert err < 2e-2, f"the kernel and the bf16 path disagree: relative error {err}"
    if out:
        with open(out, "w") as f:
            json.dump(dict(experts=E, top_k=top_k, hidden=D, intermediate=I, results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
