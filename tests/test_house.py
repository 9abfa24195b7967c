"""The house rules (scripts/check_house.py) hold: imports run web -> pipeline -> stages -> gpu,
no module over 600 lines in pipeline/, stages/ and web/, stages.schedule imports with
torch blocked, no import cycle across packages. And the check itself catches each kind."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts import check_house

ROOT = Path(__file__).resolve().parents[1]


def test_the_house_holds():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_house.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for layer in check_house.LAYERS:
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "stages" / "schedule.py").write_text("")    # imports without torch
    return tmp_path


def test_the_check_sees_upward_imports_and_cycles(tmp_path):
    root = _tree(tmp_path, {
        "pipeline/a.py": "def f():\n    from web import b\n",     # deferred: counts too
        "web/b.py": "import pipeline.a\n",
        "gpu/c.py": "from ..stages import schedule\n",
    })
    found = check_house.violations(root)
    assert any("pipeline/a.py:2: pipeline.a imports web.b (pipeline -> web)" in v for v in found)
    assert any("gpu.c imports stages.schedule (gpu -> stages)" in v for v in found)
    assert any(v.startswith("import cycle across pipeline, web") for v in found), found


def test_the_check_sees_long_modules_and_torch(tmp_path):
    root = _tree(tmp_path, {"web/long.py": "x = 1\n" * 601, "gpu/long.py": "x = 1\n" * 601})
    (root / "stages" / "schedule.py").write_text("import torch\n")
    found = check_house.violations(root)
    assert sorted(v for v in found if v.startswith("long module")) == [
        "long module: gpu/long.py has 601 lines (at most 600)",
        "long module: web/long.py has 601 lines (at most 600)"]
    assert any(v.startswith("torch import: stages.schedule") for v in found)


def test_a_clean_tree_passes(tmp_path):
    assert check_house.violations(_tree(tmp_path, {"web/b.py": "import pipeline\n"})) == []


def test_the_check_sees_cycles_inside_a_package_at_run_time(tmp_path):
    root = _tree(tmp_path, {
        "web/a.py": "def f():\n    from web import b\n",          # deferred: it runs
        "web/b.py": "import web.a\n",
        "pipeline/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import d\n",
        "pipeline/d.py": "import pipeline.c\n",                   # type-only the other way
    })
    found = check_house.violations(root)
    assert "import cycle at run time inside web: web.a, web.b" in found, found
    assert not any("inside pipeline" in v for v in found), found


def test_the_check_holds_stages_to_the_contract(tmp_path):
    root = _tree(tmp_path, {
        "gpu/interface.py": "", "gpu/config/__init__.py": "", "gpu/config/model.py": "",
        "gpu/worker/__init__.py": "", "gpu/worker/runner.py": "",
        "stages/render.py": "from gpu.interface import x\nfrom gpu.config.model import y\n",
        "stages/admit.py": "def f():\n    from gpu.worker.runner import z\n",
    })
    found = [v for v in check_house.violations(root) if v.startswith("contract")]
    assert found == ["contract: stages/admit.py:2: stages.admit imports gpu.worker.runner "
                     "(stages/ import only " + ", ".join(check_house.CONTRACT) + ")"], found
