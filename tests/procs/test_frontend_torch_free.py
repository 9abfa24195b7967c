"""A frontend process of --api-server-count never loads torch: its modules import with
torch, triton and xgrammar blocked (the check of tests/stages/test_torch_free.py)."""
import subprocess
import sys
from pathlib import Path

CHECK = (Path(__file__).parents[1] / "stages" / "test_torch_free.py").read_text()
MODULES = ("pipeline.layouts.frontend", "pipeline.layouts.wire", "pipeline.core.client",
           "pipeline.layouts.procs", "pipeline.layouts.process", "pipeline.core.logs",
           "web.server", "web.child")


def test_the_frontend_process_imports_without_torch():
    namespace: dict = {}
    exec(compile(CHECK, "test_torch_free.py", "exec"), namespace)
    done = subprocess.run([sys.executable, "-c", namespace["_CHECK"], *MODULES],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
