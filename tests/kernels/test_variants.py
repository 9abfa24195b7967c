"""No Triton compile in the middle of a run: every kernel binds to one compiled variant
whatever the step's batch size (scripts/check_triton_compile.py --variants: the installed
Triton's own binder, nothing compiled, no GPU needed; run apart because the interpreter,
on here for the other kernel tests, has no binder)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_variant_per_kernel_at_any_batch_size():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_triton_compile.py"), "--variants"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK  ") == 13 and "FAIL" not in proc.stdout   # 3: Gated DeltaNet, 1: MLA decode
