"""The kernel tests' tiny random Qwen3 (2 layers, 96-token vocabulary; load it with
load_format="dummy"): its config, a pair of runners over it (torch and Triton paths), and a
stand-in for CUDA graph capture that replays the recorded forward eagerly (CPU, under
TRITON_INTERPRET=1)."""
from __future__ import annotations

import json

import torch

from gpu.layers.attention import KVCache
from gpu.loader.decoder import load_model
from gpu.worker.runner import ModelRunner

# A tiny random Qwen3 (2 layers, 96-token vocabulary) for the runner-level tests.
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True}


def runner_pair(tmp_path, device):
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    lm = load_model(tmp_path, load_format="dummy", dtype="float32", device=str(device), seed=1,
                    progress=False).model
    c = lm.config

    def make(use_triton: bool) -> ModelRunner:
        cache = KVCache(c.num_hidden_layers, 12, 4, c.num_key_value_heads, c.head_dim, torch.float32, device)
        return ModelRunner(lm, cache, device=device, use_triton=use_triton)

    return lm, make(False), make(True)


class EagerGraph:
    """A captured graph's stand-in: replay runs the forward the capture recorded."""

    def __init__(self, graphs, bs: int) -> None:
        self.graphs, self.bs, self.replays = graphs, bs, 0

    def replay(self) -> None:
        self.replays += 1
        self.graphs.attn.prepare(self.graphs._views(self.bs))
        self.graphs._forward(self.bs)


def fake_capture(graphs) -> None:
    graphs.graphs = {bs: EagerGraph(graphs, bs) for bs in graphs.sizes}
