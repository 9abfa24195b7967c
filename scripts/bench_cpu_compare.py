"""Side by side, in one run: tailrace in each --dtypes vs Hugging Face transformers'
generate (one padded batch, in each --hf-dtypes) on the same SmolLM2 weights on the CPU,
for N concurrent requests of fixed input/output length, greedy, with ignore_eos. Prints
one JSON object per contender and a summary table.

    .venv/bin/python scripts/bench_cpu_compare.py --num-prompts 32 --input-len 128 --output-len 128 \
        --dtypes float32 bfloat16 --hf-dtypes bfloat16 --hf-serial-prompts 0

HF one-at-a-time is slow (~70 ms/token), so it runs --hf-serial-prompts of the prompts and
reports tokens/s over those. A --dtypes entry DTYPE:RESIDUAL sets --residual-dtype too
(bfloat16:bfloat16 is the pure-bf16 path; plain bfloat16 on CPU has an fp32 residual stream);
a /torch suffix runs that contender without gpu/kernels/cpu/ops.c (TAILRACE_CPU_KERNELS=0: gather +
SDPA decode attention, torch's norms and rope), for an A/B in one run:

    .venv/bin/python scripts/bench_cpu_compare.py --dtypes bfloat16 bfloat16/torch bfloat16 bfloat16/torch \
        --hf-dtypes bfloat16 float32
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import trio

from pipeline.tools.bench import _bench, make_requests
from pipeline.core.config import EngineConfig


def hf_model(path: str | None, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu.loader.decoder import default_model_path
    from gpu.formats.gguf import GGUFFile

    f = GGUFFile(path or default_model_path())
    cfg = f.config_dict()
    cfg.pop("model_type")
    model = LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="float32"))
    state = dict(f.named_tensors())
    if cfg["tie_word_embeddings"]:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=False)
    return model.to(dtype).eval()


def hf_generate(model, prompts: list[list[int]], out_len: int) -> tuple[int, float]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    return (out.shape[1] - ids.shape[1]) * len(prompts), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--hf-dtypes", nargs="+", default=["bfloat16"])
    p.add_argument("--hf-serial-prompts", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    a = p.parse_args()
    s = dict(num_prompts=a.num_prompts, min_input_len=None, input_len=a.input_len, min_output_len=None,
             output_len=a.output_len, seed=0, ignore_eos=True)
    prompts = [r["prompt"] for r in make_requests(s, 49152, 0.0)]
    rows = []
    from gpu.kernels.cpu import ops as cpu_kernels
    for spec in a.dtypes:
        spec_dtype, _, path = spec.partition("/")
        dtype, _, residual = spec_dtype.partition(":")  # bfloat16:bfloat16 -> --residual-dtype bfloat16
        cfg = EngineConfig(dtype=dtype, residual_dtype=residual or "auto", max_model_len=a.input_len + a.output_len + 16,
                           max_num_seqs=max(a.num_prompts, 1), max_queued_requests=max(1024, a.num_prompts))
        saved = os.environ.get(cpu_kernels.DISABLE_ENV)
        if path == "torch":
            os.environ[cpu_kernels.DISABLE_ENV] = "0"
        cpu_kernels.kernels.cache_clear()
        try:
            r = trio.run(_bench, cfg, s, 0.0)
        finally:
            os.environ.pop(cpu_kernels.DISABLE_ENV, None)
            if saved is not None:
                os.environ[cpu_kernels.DISABLE_ENV] = saved
            cpu_kernels.kernels.cache_clear()
        rows.append((f"tailrace {spec} (continuous batching)", r["output_tokens"], r["elapsed_s"]))
        print(json.dumps({"contender": rows[-1][0], **r}), flush=True)
    if not a.skip_hf:
        for dtype in a.hf_dtypes:
            model = hf_model(None, getattr(torch, dtype))
            n, t = hf_generate(model, prompts, a.output_len)
            rows.append((f"HF generate {dtype}, padded batch of {len(prompts)}", n, t))
            print(json.dumps({"contender": rows[-1][0], "tokens": n, "seconds": round(t, 3)}), flush=True)
            if a.hf_serial_prompts:
                total_n = total_t = 0.0
                for pr in prompts[:a.hf_serial_prompts]:
                    n, t = hf_generate(model, [pr], a.output_len)
                    total_n += n
                    total_t += t
                rows.append((f"HF generate {dtype}, one at a time ({a.hf_serial_prompts} of them)",
                             int(total_n), total_t))
    print(f"\n{'contender':55s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>7s}")
    for name, n, t in rows:
        print(f"{name:55s} {n:7d} {t:8.2f} {n / t:7.1f}")


if __name__ == "__main__":
    main()
