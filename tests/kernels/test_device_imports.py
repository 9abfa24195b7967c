"""The GPU image lacks packages the dev venv has (openai-harmony, pydantic, quart, ...):
the entry points scripts/gpu_check.sh runs must import without them.

Each check runs in a subprocess with scripts/device_image/sitecustomize.py's blocker on:
every installed package the image lacks and scripts/fetch_gpu_wheels.sh does not carry
raises ImportError, as on the image."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "scripts" / "device_image"


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TAILRACE_DEVICE_IMAGE="1",
               PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)   # gpu.kernels.bench sets it itself without CUDA
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_blocker_blocks_what_the_image_lacks():
    r = _run("import sitecustomize as s; b = s.missing_modules(); "
             "assert 'openai_harmony' in b and 'quart' in b, sorted(b); "
             "assert 'torch' not in b and 'trio' not in b and 'xgrammar' not in b, sorted(b)\n"
             "try:\n    import openai_harmony\nexcept ImportError as e:\n    print('blocked', e)\n"
             "else:\n    raise SystemExit('openai_harmony imported')")
    assert r.returncode == 0, r.stderr
    assert "blocked" in r.stdout and "not on the GPU image" in r.stdout


@pytest.mark.parametrize("module", ["pipeline.tools.bench", "gpu.kernels.bench"])
def test_entry_points_import_without_the_missing_packages(module):
    r = _run(f"import {module}, sys; "
             "bad = [m for m in ('openai_harmony', 'quart', 'hypercorn', 'pydantic_core') "
             "if m in sys.modules]; assert not bad, bad")
    assert r.returncode == 0, r.stderr[-3000:]
