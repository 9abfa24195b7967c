"""gpu/kernels/triton/compile_count.py, which pipeline.tools.bench reads around its timed window, and
the graphs-vs-eager check (scripts/check_graph_splits.py) at a tiny size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_compiled_kernels_reads_the_launch_caches():
    # without the interpreter: real JITFunctions, nothing compiled yet; a fake entry in one
    # kernel's launch cache counts as one compile
    code = ("import gpu.kernels.triton.rmsnorm as r, gpu.kernels.triton.paged_attention\n"
            "from gpu.kernels.triton.compile_count import compiled_kernels\n"
            "assert compiled_kernels() == 0, compiled_kernels()\n"
            "r._rms_norm_kernel.device_caches[0] = ({'key': object()}, None, None, None, None)\n"
            "print(compiled_kernels())")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stdout + r.stderr


def test_compiled_kernels_is_none_under_the_interpreter():
    import gpu.kernels.triton.rmsnorm  # noqa: F401
    from gpu.kernels.triton.compile_count import compiled_kernels
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert compiled_kernels() is None


def test_graph_splits_check_eager_half(tmp_path):
    if torch.cuda.is_available():   # the GPU runs the full check in gpu_check.sh step 2b
        return
    from scripts.check_graph_splits import check
    from tests.support.tiny_runners import TINY_QWEN3

    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    result = check(str(tmp_path), "float32", [1, 5], [3], max_ctx=70)
    assert result["ok"] and len(result["results"]) == 2
    assert all(r["eager_err"] < 1e-4 for r in result["results"])
