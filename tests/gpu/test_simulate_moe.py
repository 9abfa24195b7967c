"""The H200 stand-in (gpu/worker/simulate.py) prices the mixtures from their published configs:
every expert held, top-k (plus the shared expert) run, dense layers where the config has
them, and DeepSeek-V3's latent KV cache."""
import json
from pathlib import Path

import pytest

import gpu
from gpu.models.registry import config_from_hf
from gpu.worker.simulate import GPUS, CostModel

CONFIGS = Path(gpu.__file__).parent / "configs"


@pytest.mark.parametrize("name, total, active, kv_bytes", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 48 * 2 * 4 * 128 * 2),       # 48 layers, K and V of 4 heads of 128
    ("deepseek-v3", 671e9, 37e9, 61 * 576 * 2),                   # 61 layers, one 576-wide latent row
])
def test_published_parameter_counts_and_kv_bytes(name, total, active, kv_bytes):
    c = config_from_hf(json.loads((CONFIGS / name / "config.json").read_text()))
    cost = CostModel.of(c, GPUS["h200"])
    embed = c.vocab_size * c.hidden_size                          # a lookup, not a matmul
    assert cost.matmul_params + embed == pytest.approx(total, rel=0.02)
    assert cost.active_params + embed == pytest.approx(active, rel=0.04)
    assert cost.kv_bytes_per_token == kv_bytes
    one, many = cost.step_seconds([1], [1000], 1), cost.step_seconds([1] * 64, [1000] * 64, 64)
    assert one < many < 64 * one
