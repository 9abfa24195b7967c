"""CPU time of one gpt-oss MoE layer: gpu/moe.py as it runs on CPU ("ours": padded bmm or one
matmul per expert segment, by the routing), each of those alone, torch's grouped_mm (its CUDA
bf16 path) and transformers' GptOssExperts loop (one expert at a time, gathering the tokens routed to it),
on the same weights and routing. Interleaved, best of N, so that a busy
machine hurts all alike.

    .venv/bin/python scripts/bench_moe.py --hidden 512 --experts 32 --top-k 4 --tokens 1 16 256
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gpu import moe as moe_mod
from gpu.config import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()
