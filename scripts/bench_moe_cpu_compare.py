"""Side by side, in one run: tailrace vs Hugging Face transformers' generate (one batch) on
the same tiny-but-not-trivial random Qwen3-MoE on the CPU (issue 56): N concurrent requests of
fixed input/output length, greedy, ignore_eos, fp32 (this machine has no native bf16).

    PYTHONPATH=. .venv/bin/python scripts/bench_moe_cpu_compare.py --num-prompts 32 --input-len 64 --output-len 64

The model: hidden 512, 4 layers, 8 query heads over 4 KV heads of 64, 8 experts top-2 of
intermediate 768, a 8,192-token vocabulary (about 60M parameters, 20M active a token).

    ... --gguf Q8_0

writes the same model as a qwen3moe GGUF in that format (as llama.cpp's converter lays it out:
the experts stacked as ffn_{gate,up,down}_exps) and serves the file, its linears and experts
kept packed (the CPU default); transformers loads the same file (from_pretrained(gguf_file=),
dequantized to fp32) for its generate.

    ... --rounds 3

runs the two sides alternately, three times each (tailrace, HF, tailrace, HF, ...), each round
timed by wall clock and by the process's CPU time (every thread: tailrace's engine runs in this
process), and prints each round's ratios and their medians: on a shared machine one pair's
wall-clock ratio says whose slice of the CPU was larger; the CPU-time ratio moves less. The
thread count is the environment's (OMP_NUM_THREADS) for both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
    p.add_argument("--gguf", choices=["Q8_0", "Q4_0"], default=None,
                   help="serve the model as a GGUF file of this format (HF generate loads the same file)")
    p.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times")
    a = p.parse_args()
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).eval()
    s = dict(num_prompts=a.num_prompts, min_input_len=None, input_len=a.input_len, min_output_len=None,
             output_len=a.output_len, seed=0, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model, what = d, "float32"
        if a.gguf:
            model, what = f"{d}/tiny-qwen3moe.{a.gguf}.gguf", f"GGUF {a.gguf} packed"
            write_qwen3moe_gguf(hf, model, a.gguf)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=model.rsplit("/", 1)[1],
                                                                   dtype=torch.float32).eval()
        else:
            hf.save_pretrained(d)
        cfg = EngineConfig(model=model, dtype="auto" if a.gguf else "float32",
                           max_model_len=a.input_len + a.output_len + 16,
                           max_num_seqs=a.num_prompts, max_queued_requests=max(1024, a.num_prompts))
        prompts = [q["prompt"] for q in make_requests(s, CONFIG["vocab_size"], 0.0)]
        ids = torch.tensor(prompts)
        pairs = []
        for rnd in range(a.rounds):
            r = trio.run(_bench, cfg, s, 0.0)
            rows.append((f"tailrace {what} (continuous batching)", r["output_tokens"], r["elapsed_s"]))
            print(json.dumps({"round": rnd, "contender": rows[-1][0], "load": _load(), **r}), flush=True)
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.output_len,
                                  min_new_tokens=a.output_len, do_sample=False, pad_token_id=0)
            hf_s, hf_cpu = time.perf_counter() - t0, time.process_time() - c0
            rows.append((f"HF generate float32{' (the GGUF dequantized)' if a.gguf else ''}, one batch of {len(prompts)}",
                         (out.shape[1] - ids.shape[1]) * len(prompts), hf_s))
            print(json.dumps({"round": rnd, "contender": rows[-1][0], "load": _load(), "tokens": rows[-1][1],
                              "seconds": round(hf_s, 3), "cpu_s": round(hf_cpu, 3)}), flush=True)
            pairs.append((hf_s / r["elapsed_s"], hf_cpu / r["cpu_s"]))
    print(f"\n{'contender':45s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>7s}")
    for name, n, t in rows:
        print(f"{name:45s} {n:7d} {t:8.2f} {n / t:7.1f}")
    print("\nround  tailrace / HF output tok/s: wall clock, CPU time")
    for i, (w, c) in enumerate(pairs):
        print(f"{i:5d}  {w:5.2f}x  {c:5.2f}x")
    if len(pairs) > 1:
        w, c = zip(*pairs)
        print(f"median {statistics.median(w):5.2f}x  {statistics.median(c):5.2f}x "
              f"(wall {min(w):.2f}-{max(w):.2f}, CPU {min(c):.2f}-{max(c):.2f})")


def _load() -> float:
    return os.getloadavg()[0]

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(hf, path: str, fmt: str) -> None:
    """hf as llama.cpp's convert_hf_to_gguf.py writes a Qwen3MoeForCausalLM: matrices in fmt
    (the router too), the experts stacked [E, rows, cols], norms in fp32."""
    import gguf
    import numpy as np

    c, qtype = hf.config, gguf.GGMLQuantizationType[fmt]
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in (("vocab_size", c.vocab_size), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("block_count", c.num_hidden_layers),
                       ("feed_forward_length", c.intermediate_size),
                       ("expert_feed_forward_length", c.moe_intermediate_size), ("expert_count", c.num_experts),
                       ("expert_used_count", c.num_experts_per_tok), ("head_count", c.num_attention_heads),
                       ("head_count_kv", c.num_key_value_heads), ("key_length", c.head_dim),
                       ("value_length", c.head_dim), ("rope_freq_base", c.rope_parameters["rope_theta"]),
                       ("layer_norm_rms_eps", c.rms_norm_eps)):
        getattr(w, f"add_{key}")(value)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, t in hf.state_dict().items():
        arr = t.float().numpy()
        if name in top:
            out = [(top[name], arr)]
        else:
            _, _, layer, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            if base == "mlp.experts" and kind == "gate_up_proj":        # [E, 2I, D]: gate, then up
                gate, up = np.split(arr, 2, axis=1)
                out = [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
            elif base == "mlp.experts":
                out = [(f"blk.{layer}.ffn_down_exps.weight", arr)]
            else:
                out = [(f"blk.{layer}.{_BLOCK[base]}.{kind}", arr)]
        for gname, x in out:
            if x.ndim >= 2:
                w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(x), qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
