"""Fixtures for the kernel tests: CUDA when present, else CPU under the Triton interpreter."""

import json

import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# Per-dtype tolerances for outputs of magnitude ~1 computed in fp32 and rounded on store.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2e-2),
}


@pytest.fixture
def tol():
    return lambda dtype: TOLERANCES[dtype]


# A tiny random Qwen3 (2 layers, 96-token vocabulary) for the runner-level tests.
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True}


@pytest.fixture
def tiny_qwen3_dir(tmp_path):
    """A folder holding TINY_QWEN3's config.json (load it with load_format="dummy")."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    return tmp_path
