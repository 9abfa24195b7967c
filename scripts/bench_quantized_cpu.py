"""CPU decode steps of pre-quantized checkpoints against the same model dense, side by side.

The bundled SmolLM2-135M (a Q4_1 GGUF) is dequantized to float32 and written as a HF checkpoint,
then quantized from those weights into a GPTQ W4A16 checkpoint (symmetric, group 64, fp16
scales: 576 columns are not a multiple of 128) and a compressed-tensors W8A8 one (int8 per
channel, bf16 scales). All three load with --quantization auto (the quantized ones repacked
exactly into Q4_0 / Q8_0 blocks for the packed CPU kernels, gpu/quantization/repack.py), and
their decode steps (scripts/profile_cpu_step.py's make_decoder: ModelRunner, paged KV cache,
greedy sampling) are timed alternately, --rounds times, at each --num-seqs.

    .venv/bin/python scripts/bench_quantized_cpu.py --num-seqs 1 32 --rounds 3
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu.formats.gguf import GGUFFile
from gpu.loader.decoder import _as_checkpoint, cpu_threads, load_model
from gpu.quantization.awq import pack_columns
from gpu.tokenizers.files import default_model_path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _profile_module():
    spec = importlib.util.spec_from_file_location("profile_cpu_step", Path(__file__).with_name("profile_cpu_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gptq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Symmetric 4-bit GPTQ ("gptq" format: zeros stored as 8 - 1) of w [out, in]."""
    out, cols = w.shape
    g = w.float().reshape(out, cols // group, group)
    s = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).half()                          # [out, groups]
    q = (torch.round(g / s.float().unsqueeze(-1)) + 8).clamp(0, 15).long().reshape(out, cols)
    return {"qweight": pack_columns(q, 4).t().contiguous(),                     # [in / 8, out]
            "qzeros": pack_columns(torch.full((cols // group, out), 7), 4),
            "scales": s.t().contiguous(), "g_idx": (torch.arange(cols) // group).int()}


def w8a8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    s = (w.float().abs().amax(1, keepdim=True) / 127).clamp(min=1e-8).bfloat16()
    return {"weight": torch.round(w.float() / s.float()).clamp(-128, 127).to(torch.int8), "weight_scale": s}


def write(root: Path) -> dict[str, Path]:
    lm = load_model(None, dtype="float32", quantization="none", progress=False).model
    config = GGUFFile.open(default_model_path()).config_dict()
    dense = {n: t.detach().contiguous() for n, t in _as_checkpoint(lm, lm.named_parameters())}
    paths = {}
    for kind in ("dense", "gptq", "w8a8"):
        tensors, cfg = {}, dict(config)
        for name, t in dense.items():
            prefix, _, leaf = name.rpartition(".")
            if kind == "dense" or leaf != "weight" or prefix.rsplit(".", 1)[-1] not in LINEARS:
                tensors[name] = t
                continue
            for suffix, q in (gptq(t, 64) if kind == "gptq" else w8a8(t)).items():
                tensors[f"{prefix}.{suffix}"] = q
        if kind == "gptq":
            cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
                                          "sym": True}
        elif kind == "w8a8":
            cfg["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
        (root / kind).mkdir()
        save_file(tensors, str(root / kind / "model.safetensors"))
        (root / kind / "config.json").write_text(json.dumps(cfg))
        paths[kind] = root / kind
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    prof = _profile_module()
    print(cpu_threads())
    with tempfile.TemporaryDirectory() as d:
        paths = write(Path(d))
        models = {}
        for kind, path in paths.items():
            loaded = load_model(path, progress=False)
            print(f"{kind}: {loaded.weights}")
            models[kind] = loaded.model
        for n in a.num_seqs:
            decoders = {kind: (prof.make_decoder(lm, n), []) for kind, lm in models.items()}
            step = 1
            for rnd in range(a.rounds):
                for kind, (decode, medians) in decoders.items():
                    times = sorted(decode(s) for s in range(step, step + a.steps))
                    step += a.steps
                    medians.append(times[len(times) // 2])
            base = statistics.median(decoders["dense"][1])
            for kind, (_, medians) in decoders.items():
                mid = statistics.median(medians)
                print(f"{n} streams, {kind}: decode step median of {a.rounds} rounds' medians {mid * 1e3:.1f} ms "
                      f"(rounds {min(medians) * 1e3:.1f}-{max(medians) * 1e3:.1f}), {base / mid:.2f}x dense")


if __name__ == "__main__":
    main()
