"""Greedy decoding end to end through the runner: the Triton path (write_kv + paged
attention, CUDA graphs for decodes, device sampling) against the torch path (SDPA, host
sampling) on the same weights, in the same dtype (bf16 on the GPU: the attention kernel's
tensor-core path, P cast to bf16 before P·V, runs here).

    python scripts/compare_paths.py --config gpu/configs/qwen3-0.6b --dtype bfloat16 \
        --out results/bf16_greedy.json

Both runners execute the same plans: one prefill of every prompt, then decode steps fed
with the Triton path's greedy tokens (the torch path is teacher-forced with them), so
each step's logits compare row for row. Reported: the greedy agreement (rows where both
paths pick the same token), the largest and mean logit difference relative to the
logits' spread, and whether CUDA graphs ran. Exit 1 when the paths disagree beyond what
the dtype explains (--min-agreement, --max-rel-err).

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

from gpu.attention import KVCache  # noqa: E402
from gpu.loader import load_model  # noqa: E402
from gpu.runner import ModelRunner, SeqChunk, SeqStart, StepPlan  # noqa: E402
from gpu.sampler import SamplingOptions  # noqa: E402


def compare(config: str, dtype: str, prompt_lens: list[int], new_tokens: int, block_size: int = 16,
            seed: int = 0) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_model(config, load_format="dummy", dtype=dtype, device=str(device), seed=seed,
                    progress=False).model
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

    def runner(use_triton: bool) -> ModelRunner:
        cache = KVCache(c.num_hidden_layers, at, block_size, c.num_key_value_heads, c.head_dim, lm.dtype, device)
        return ModelRunner(lm, cache, device=device, use_triton=use_triton, max_model_len=max_len,
                           cuda_graph_max_bs=len(prompts) if device.type == "cuda" else 0)

    t0 = time.perf_counter()
    triton_runner, torch_runner = runner(True), runner(False)
    greedy = SamplingOptions(temperature=0.0)
    ids = [f"s{i}" for i in range(len(prompts))]
    first = StepPlan(1, tuple(SeqChunk(s, tuple(p), 0, t, True) for s, p, t in zip(ids, prompts, tables)),
                     tuple(SeqStart(s, tuple(p), greedy) for s, p in zip(ids, prompts)))

    seen: list[torch.Tensor] = []
    orig = lm.compute_logits
    lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
    rows = agree = 0
    max_abs = sum_abs = 0.0
    spread = 0.0
    try:
        plan = first
        for step in range(new_tokens):
            seen.clear()
            a = triton_runner.execute(plan)
            b = torch_runner.execute(plan)
            la, lb = seen[0].float(), seen[1].float()
            diff = (la - lb).abs()
            max_abs = max(max_abs, diff.max().item())
            sum_abs += diff.mean().item()
            spread = max(spread, lb.std().item())
            rows += len(a.token_ids)
            agree += sum(x == y for x, y in zip(a.token_ids, lb.argmax(-1).tolist()))
            pos = [len(p) + step for p in prompts]
            plan = StepPlan(step + 2, tuple(SeqChunk(s, (tok,), n, t, True)
                                            for s, tok, n, t in zip(ids, a.token_ids, pos, tables)))
    finally:
        lm.compute_logits = orig
    return dict(device=str(device), dtype=dtype, config=config, prompts=len(prompts),
                prompt_lens=prompt_lens, new_tokens=new_tokens, rows=rows,
                greedy_agreement=round(agree / rows, 4), max_abs_logit_diff=round(max_abs, 5),
                mean_abs_logit_diff=round(sum_abs / new_tokens, 6), logit_std=round(spread, 4),
                max_rel_err=round(max_abs / max(spread, 1e-9), 5),
                cuda_graphs=triton_runner.cuda_graphs, elapsed_s=round(time.perf_counter() - t0, 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpu/configs/qwen3-0.6b", help="model directory or config.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-lens", default="5,17,33,64,100,128,7,250")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--min-agreement", type=float, default=0.9)
    p.add_argument("--max-rel-err", type=float, default=0.1,
                   help="largest logit difference over the logits' standard deviation")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = compare(args.config, args.dtype, [int(x) for x in args.prompt_lens.split(",")], args.new_tokens)
    result["ok"] = (result["greedy_agreement"] >= args.min_agreement
                    and result["max_rel_err"] <= args.max_rel_err)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
