"""Weight bytes a decode step reads and the process's RSS, for the bundled SmolLM2 under one
--quantization (issue 39): after load_model and one 8-token forward (which makes the oneDNN
packed copies the dequantized path reads).

    .venv/bin/python scripts/weight_bytes.py none
    .venv/bin/python scripts/weight_bytes.py gguf
"""
import sys

import torch

from gpu.layers.attention_dense import DenseCausalAttention
from gpu.kernels.cpu.quant import PackedLinear
from gpu.loader.decoder import load_model
from gpu.models.causal_lm import Linear


def main() -> None:
    q = sys.argv[1] if len(sys.argv) > 1 else "auto"
    lm = load_model(None, quantization=q, progress=False)
    with torch.inference_mode():
        ids = torch.arange(8) + 100
        lm.model.compute_logits(lm.model(ids, torch.arange(8), DenseCausalAttention()))
    rss = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) / 1024
    per_step = sum(m.packed_bytes for m in lm.model.modules() if isinstance(m, PackedLinear)) + sum(
        m.weight.numel() * m.weight.element_size() for m in lm.model.modules() if isinstance(m, Linear))
    print(f"--quantization {q}: {lm.weights}\n  RSS {rss:.0f} MB, linear weight bytes per step {per_step / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
