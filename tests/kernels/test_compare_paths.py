"""scripts/compare_paths.py (gpu_check's bf16 greedy step) on a tiny model: the Triton and
torch paths agree token for token. On the GPU gpu_check runs it at Qwen3-0.6B in bf16."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_qkv"])
def test_a_wrong_kernel_fails_the_comparison(tiny_qwen3_dir, monkeypatch, fused):
    """Negative control: attention that scales q wrongly is far from the reference.

    The wrong scale goes into `attend`, which both of TritonPagedAttention's paths call: the
    unfused one (`forward`: write_kv, then attend; the CPU's) and the fused one the model
    takes on CUDA (`write_qkv`'s q/k norm + RoPE + KV write, then attend). fused_qkv forces
    one or the other on either device (the fused kernel runs under the interpreter here),
    and the patch must have bitten on the path taken."""
    from gpu.layers import attention

    cls = attention.TritonPagedAttention
    init, attend, paths = cls.__init__, cls.attend, []

    def init_on(self, *a, **kw):
        init(self, *a, **kw)
        self.fused_qkv = fused

    def wrong(self, layer, q, **kw):
        paths.append(self.fused_qkv)
        return attend(self, layer, q * 1.5, **kw)

    monkeypatch.setattr(cls, "__init__", init_on)
    monkeypatch.setattr(cls, "attend", wrong)
    script = _script()
    result = script.compare(str(tiny_qwen3_dir), "float32", [3, 9, 20], 3)
    assert paths and set(paths) == {fused}          # the wrong kernel ran, on the path asked for
    assert not script.judge(result, 3.0)
