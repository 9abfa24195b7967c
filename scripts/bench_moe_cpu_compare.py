"""Side by side, in one run: tailrace vs Hugging Face transformers' generate (one batch) on
the same tiny-but-not-trivial random Qwen3-MoE on the CPU (issue 56): N concurrent requests of
fixed input/output length, greedy, ignore_eos, fp32 (this machine has no native bf16).

    PYTHONPATH=. .venv/bin/python scripts/bench_moe_cpu_compare.py --num-prompts 32 --input-len 64 --output-len 64

The model: hidden 512, 4 layers, 8 query heads over 4 KV heads of 64, 8 experts top-2 of
intermediate 768, a 8,192-token vocabulary (about 60M parameters, 20M active a token).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import trio

from pipeline.core.config import EngineConfig
from pipeline.tools.bench import _bench, make_requests

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=768,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024, initializer_range=0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args()
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).eval()
    s = dict(num_prompts=a.num_prompts, min_input_len=None, input_len=a.input_len, min_output_len=None,
             output_len=a.output_len, seed=0, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        cfg = EngineConfig(model=d, dtype="float32", max_model_len=a.input_len + a.output_len + 16,
                           max_num_seqs=a.num_prompts, max_queued_requests=max(1024, a.num_prompts))
        r = trio.run(_bench, cfg, s, 0.0)
        rows.append(("tailrace float32 (continuous batching)", r["output_tokens"], r["elapsed_s"]))
        print(json.dumps({"contender": rows[-1][0], **r}), flush=True)
    prompts = [q["prompt"] for q in make_requests(s, CONFIG["vocab_size"], 0.0)]
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.output_len,
                          min_new_tokens=a.output_len, do_sample=False, pad_token_id=0)
    rows.append((f"HF generate float32, one batch of {len(prompts)}", (out.shape[1] - ids.shape[1]) * len(prompts),
                 time.perf_counter() - t0))
    print(json.dumps({"contender": rows[-1][0], "tokens": rows[-1][1], "seconds": round(rows[-1][2], 3)}), flush=True)
    print(f"\n{'contender':45s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>7s}")
    for name, n, t in rows:
        print(f"{name:45s} {n:7d} {t:8.2f} {n / t:7.1f}")


if __name__ == "__main__":
    main()
