"""Multi-LoRA throughput (issue 33): 32 streams x 128/128 on SmolLM2, side by side in one run.

One `tailrace serve --enable-lora` subprocess serves five random PEFT adapters made here
(rank 16, and ranks 8, 16, 32, 64 on every q/k/v/o/gate/up/down linear), and three phases
run one after the other against it, each STREAMS concurrent completions of PROMPT random
token ids and OUTPUT tokens (ignore_eos, greedy):
  base    every request on the base model
  one16   every request on the rank-16 adapter
  mix4    requests spread round-robin over the four adapters of ranks 8-64
For each phase: wall time, output tokens/s, and the mean inter-token gap of the streams (the
decode step time as a client sees it). The ratio mix4 / base is the LoRA cost.

    python scripts/bench_lora.py [--streams 32 --prompt 128 --output 128 --dtype float32]
                                 [--phases base,mix4 --rounds 2]
TAILRACE_LORA_BACKEND=torch|cpu in the environment picks the server's LoRA path (default: the
C kernel on the CPU).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: Path, r: int, cfg, seed: int) -> None:
    """A PEFT-format adapter with random A and B (its outputs are noise: this measures cost)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hd = cfg["head_dim"]
    outs = {"q_proj": cfg["heads"] * hd, "k_proj": cfg["kv_heads"] * hd, "v_proj": cfg["kv_heads"] * hd,
            "o_proj": cfg["hidden"], "gate_proj": cfg["inter"], "up_proj": cfg["inter"],
            "down_proj": cfg["hidden"]}
    ins = {m: cfg["hidden"] for m in ALL}
    ins["o_proj"], ins["down_proj"] = cfg["heads"] * hd, cfg["inter"]
    tensors = {}
    for i in range(cfg["layers"]):
        for m in ALL:
            sub = "self_attn" if m in ALL[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{sub}.{m}"
            tensors[key + ".lora_A.weight"] = torch.randn(r, ins[m], generator=g) * 0.01
            tensors[key + ".lora_B.weight"] = torch.randn(outs[m], r, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": ALL}))


async def phase(base_url: str, models: list[str], streams: int, prompt: int, output: int,
                seed: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=3600)
    rng = random.Random(seed)
    gaps: list[float] = []

    async def one(i: int) -> int:
        ids = [rng.randrange(100, 40000) for _ in range(prompt)]
        stream = await client.completions.create(
            model=models[i % len(models)], prompt=ids, max_tokens=output, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        n, last = 0, None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text is not None:
                if last is not None:
                    gaps.append(now - last)
                last = now
                n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    await client.close()
    gaps.sort()
    return {"wall_s": round(wall, 2), "output_tok_s": round(sum(counts) / wall, 1),
            "mean_gap_ms": round(1000 * sum(gaps) / max(1, len(gaps)), 2),
            "p50_gap_ms": round(1000 * gaps[len(gaps) // 2], 2) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--kv-cache-memory-bytes", default="1Gi")
    ap.add_argument("--phases", default="base,one16,mix4",
                    help="which phases, in order (comma-separated): base, one16, mix4")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the phases this many times, interleaved (base mix4 base mix4 ...): "
                         "on a shared machine the ratios of neighbouring phases are what holds")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from gpu.loader.decoder import load_shell

    mc = load_shell(args.model).config
    cfg = dict(head_dim=mc.head_dim, heads=mc.num_attention_heads, kv_heads=mc.num_key_value_heads,
               hidden=mc.hidden_size, inter=mc.intermediate_size, layers=mc.num_hidden_layers)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    ranks = {"one16": 16, "r8": 8, "r16": 16, "r32": 32, "r64": 64}
    for i, (name, r) in enumerate(ranks.items()):
        make_adapter(tmp / name, r, cfg, i)
    cmd = [sys.executable, "-m", "web.cli", "serve", *([args.model] if args.model else []),
           "--port", "0", "--dtype", args.dtype, "--max-num-seqs", str(args.streams),
           "--kv-cache-memory-bytes", args.kv_cache_memory_bytes, "--enable-lora",
           "--max-loras", "4", "--max-cpu-loras", "5", "--max-lora-rank", "64",
           "--lora-modules", *(f"{n}={tmp / n}" for n in ranks)]
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url = None
        for line in proc.stdout:
            line = line.decode()
            if line.startswith("tailrace: listening on "):
                url = line.split("listening on ", 1)[1].strip()
                break
        if url is None:
            raise SystemExit(f"the server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
        base = url + "/v1"
        import httpx
        model = httpx.get(base + "/models").json()["data"][0]["id"]
        # warm-up: one short request of each kind
        asyncio.run(phase(base, [model, "one16", "r8", "r16", "r32", "r64"], 6, 16, 4, 0))
        phases = {"base": [model], "one16": ["one16"], "mix4": ["r8", "r16", "r32", "r64"]}
        names = args.phases.split(",")
        if unknown := set(names) - set(phases):
            raise SystemExit(f"unknown phase(s) {sorted(unknown)}: choose from {list(phases)}")
        out = {}
        for rnd in range(args.rounds):
            for name in names:
                key = name if args.rounds == 1 else f"{name}.{rnd + 1}"
                out[key] = asyncio.run(phase(base, phases[name], args.streams, args.prompt, args.output, 1))
                print(key, out[key], f"load average {os.getloadavg()[0]:.1f}", flush=True)
                if name != "base" and "base" in names:
                    ref = out["base" if args.rounds == 1 else f"base.{rnd + 1}"]
                    out[key]["gap_vs_base"] = round(out[key]["mean_gap_ms"] / ref["mean_gap_ms"], 3)
        print(json.dumps({"streams": args.streams, "prompt": args.prompt, "output": args.output,
                          "dtype": args.dtype, "lora_backend": os.environ.get("TAILRACE_LORA_BACKEND", "default"),
                          **out}, indent=1))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
