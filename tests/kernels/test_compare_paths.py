"""scripts/compare_paths.py (gpu_check's bf16 greedy step) on a tiny model: the Triton and
torch paths agree token for token. On the GPU gpu_check runs it at Qwen3-0.6B in bf16."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("compare_paths", ROOT / "scripts" / "compare_paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_greedy_paths_agree(tiny_qwen3_dir):
    out = tiny_qwen3_dir / "result.json"
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    rc = _script().main(["--config", str(tiny_qwen3_dir), "--dtype", dtype, "--prompt-lens", "3,9,20",
                         "--new-tokens", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"] and result["rows"] == 9
    if dtype == "float32":
        assert result["triton"]["greedy_agreement"] == 1.0 and result["triton"]["max_rel_err"] < 1e-3


def test_a_wrong_kernel_fails_the_comparison(tiny_qwen3_dir, monkeypatch):
    """Negative control: attention that scales q wrongly is far from the reference."""
    from gpu import attention

    forward = attention.TritonPagedAttention.forward
    monkeypatch.setattr(attention.TritonPagedAttention, "forward",
                        lambda self, layer, q, k, v, **kw: forward(self, layer, q * 1.5, k, v, **kw))
    script = _script()
    result = script.compare(str(tiny_qwen3_dir), "float32", [3, 9, 20], 3)
    assert not script.judge(result, 3.0)
