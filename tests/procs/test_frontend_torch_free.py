"""A frontend process of --api-server-count never loads torch: its modules import with
torch, triton and xgrammar blocked (tests/support/blocked_imports.py, the check
tests/stages/test_torch_free.py runs too)."""
from tests.support.blocked_imports import import_blocked

MODULES = ("pipeline.layouts.frontend", "pipeline.layouts.wire", "pipeline.core.client",
           "pipeline.layouts.procs", "pipeline.layouts.process", "pipeline.core.logs",
           "web.server", "web.child")


def test_the_frontend_process_imports_without_torch():
    done = import_blocked(*MODULES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
