"""The GPU image lacks packages the dev venv has (openai-harmony, pydantic, quart, ...):
the entry points scripts/gpu_check.sh runs must import without them.

Each check runs in a subprocess with scripts/device_image/sitecustomize.py's blocker on:
every installed package the image lacks and scripts/fetch_gpu_wheels.sh does not carry
raises ImportError, as on the image. On the image itself those packages are not installed
at all, and the carried wheels are importable only through PYTHONPATH (gpu_check.sh installs
them into a folder of their own): the subprocess keeps the caller's PYTHONPATH, behind this
repository's folders, and "lacks" means "does not import", whether blocked or absent."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "scripts" / "device_image"


def _run(code: str) -> subprocess.CompletedProcess:
    # the blocker's folder first (its sitecustomize must win), then this repository, then
    # whatever the caller had: on the image, the folder holding the carried wheels
    path = [str(SITE), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TAILRACE_DEVICE_IMAGE="1", PYTHONPATH=os.pathsep.join(path))
    env.pop("TRITON_INTERPRET", None)   # gpu.kernels.triton.bench sets it itself without CUDA
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


# Blocked where installed (the dev venv), absent on the image: either way they must not import.
LACKED = ("openai_harmony", "quart")
# On the image or in .whl/: never blocked. trio (carried) must import: on the image it is found
# only through the caller's PYTHONPATH.
PRESENT = ("torch", "trio", "xgrammar")


def test_the_blocker_blocks_what_the_image_lacks():
    r = _run("import importlib, importlib.metadata as md, sitecustomize as s\n"
             "b = s.missing_modules(); installed = set(md.packages_distributions())\n"
             f"for m in {LACKED!r}:\n"
             "    assert m in b or m not in installed, (m, sorted(b))\n"
             "    try:\n        importlib.import_module(m)\n"
             "    except ImportError as e:\n"
             "        print('blocked' if m in b else 'absent', m, e)\n"
             "        assert m not in b or 'not on the GPU image' in str(e), e\n"
             "    else:\n        raise SystemExit(m + ' imported')\n"
             f"for m in {PRESENT!r}:\n"
             "    assert m not in b, (m, sorted(b))\n"
             "import trio\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f" {m} " in r.stdout for m in LACKED), r.stdout


@pytest.mark.parametrize("module", ["pipeline.tools.bench", "gpu.kernels.triton.bench"])
def test_entry_points_import_without_the_missing_packages(module):
    r = _run(f"import {module}, sys; "
             "bad = [m for m in ('openai_harmony', 'quart', 'hypercorn', 'pydantic_core') "
             "if m in sys.modules]; assert not bad, bad")
    assert r.returncode == 0, r.stderr[-3000:]
