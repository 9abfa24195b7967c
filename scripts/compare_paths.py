"""Greedy decoding end to end through the runner: the Triton path (write_kv + paged
attention, CUDA graphs for decodes, device sampling) against the torch path (SDPA, host
sampling) on the same weights, in the same dtype (bf16 on the GPU: the attention kernel's
tensor-core path, P cast to bf16 before P·V, runs here).

    python scripts/compare_paths.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
        --out results/bf16_greedy.json

Three runners execute the same plans: one prefill of every prompt, then decode steps
fed with the Triton path's greedy tokens (the others are teacher-forced with them), so
each step's logits compare row for row: the Triton path and the torch path in the
dtype, and the torch path in fp32 on the same weights as the reference. Reported per
path: greedy agreement with the reference, the largest and mean logit error (also over
the logits' spread), and whether CUDA graphs ran. With random weights the top logits
are close, so bf16 alone flips some picks; the check is relative: exit 1 unless the
Triton path is about as close to the reference as the torch path in the same dtype
(--slack).

Without CUDA it runs on the CPU (the kernels under TRITON_INTERPRET=1): use a tiny
config and float32 there (tests/kernels/test_compare_paths.py does).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu.layers.attention import KVCache  # noqa: E402
from gpu.loader.decoder import load_model  # noqa: E402
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner  # noqa: E402


def compare(config: str, dtype: str, prompt_lens: list[int], new_tokens: int, block_size: int = 16,
            seed: int = 0) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def load(dt: str):
        return load_model(config, load_format="dummy", dtype=dt, device=str(device), seed=seed,
                          progress=False).model

    lm = load(dtype)
    # The reference: the torch path in fp32 on the same weights (dummy weights are drawn in
    # fp32 and rounded to the model's dtype), so each path's error is measured against it.
    ref = lm if dtype == "float32" else load("float32")
    c = lm.config
    rng = random.Random(seed)
    vocab = min(c.vocab_size, 10000)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in prompt_lens]
    tables, at = [], 0
    for n in prompt_lens:
        k = -(-(n + new_tokens) // block_size)
        tables.append(tuple(range(at, at + k)))
        at += k
    max_len = max(prompt_lens) + new_tokens

    def runner(model, use_triton: bool) -> ModelRunner:
        cache = KVCache(c.num_hidden_layers, at, block_size, c.num_key_value_heads, c.head_dim, model.dtype, device)
        return ModelRunner(model, cache, device=device, use_triton=use_triton, max_model_len=max_len,
                           cuda_graph_max_bs=len(prompts) if device.type == "cuda" and use_triton else 0)

    t0 = time.perf_counter()
    runners = {"triton": (lm, runner(lm, True)), "torch": (lm, runner(lm, False)),
               "reference": (ref, runner(ref, False))}
    greedy = SamplingOptions(temperature=0.0)
    ids = [f"s{i}" for i in range(len(prompts))]
    plan = StepPlan(1, tuple(SeqChunk(s, tuple(p), 0, t, True) for s, p, t in zip(ids, prompts, tables)),
                    tuple(SeqStart(s, tuple(p), greedy) for s, p in zip(ids, prompts)))

    def logits_of(model, r, plan):
        seen = []
        orig = model.compute_logits
        model.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
        try:
            result = r.execute(plan)
        finally:
            model.compute_logits = orig
        return result, seen[0].float()

    stats = {name: dict(agree=0, max_abs=0.0, sum_abs=0.0) for name in ("triton", "torch")}
    rows, spread = 0, 0.0
    for step in range(new_tokens):
        out = {name: logits_of(m, r, plan) for name, (m, r) in runners.items()}
        want = out["reference"][1]
        spread = max(spread, want.std().item())
        picks = want.argmax(-1).tolist()
        rows += len(picks)
        for name in stats:
            diff = (out[name][1] - want).abs()
            st = stats[name]
            st["max_abs"] = max(st["max_abs"], diff.max().item())
            st["sum_abs"] += diff.mean().item()
            st["agree"] += sum(x == y for x, y in zip(out[name][0].token_ids, picks))
        # every path is fed the Triton path's tokens (teacher forcing), so rows stay aligned
        tokens = out["triton"][0].token_ids
        pos = [len(p) + step for p in prompts]
        plan = StepPlan(step + 2, tuple(SeqChunk(s, (tok,), n, t, True)
                                        for s, tok, n, t in zip(ids, tokens, pos, tables)))
    result = dict(device=str(device), dtype=dtype, config=config, prompts=len(prompts),
                  prompt_lens=prompt_lens, new_tokens=new_tokens, rows=rows, logit_std=round(spread, 4),
                  cuda_graphs=runners["triton"][1].cuda_graphs, elapsed_s=round(time.perf_counter() - t0, 2))
    for name, st in stats.items():
        result[name] = dict(greedy_agreement=round(st["agree"] / rows, 4),
                            max_abs_logit_err=round(st["max_abs"], 5),
                            mean_abs_logit_err=round(st["sum_abs"] / new_tokens, 6),
                            max_rel_err=round(st["max_abs"] / max(spread, 1e-9), 5))
    return result


def judge(result: dict, slack: float) -> bool:
    """The Triton path is as close to the fp32 reference as the torch path in the same
    dtype is (within `slack` times its error, plus fp32 noise), and agrees with the
    reference's greedy picks about as often."""
    tri, tor = result["triton"], result["torch"]
    close = tri["max_rel_err"] <= slack * tor["max_rel_err"] + 1e-3
    agree = tri["greedy_agreement"] >= tor["greedy_agreement"] - 0.1
    return close and agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpu/configs/qwen3-0.6b", help="model directory or config.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-lens", default="5,17,33,64,100,128,7,250")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--slack", type=float, default=3.0,
                   help="the Triton path's largest logit error may be this many times the torch path's")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = compare(args.config, args.dtype, [int(x) for x in args.prompt_lens.split(",")], args.new_tokens)
    result["ok"] = judge(result, args.slack)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
