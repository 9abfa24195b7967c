"""The torch-free check both tests/stages/test_torch_free.py and
tests/procs/test_frontend_torch_free.py run: import modules in a fresh interpreter with
torch, triton and xgrammar blocked. A support module, so that neither test has to read or
exec the other's file."""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("torch", "triton", "xgrammar")

CHECK = textwrap.dedent(f"""
    import importlib, importlib.abc, sys

    BLOCKED = {BLOCKED!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: the frontend must not import it")
            return None

    sys.meta_path.insert(0, Block())
    for name in sys.argv[1:]:
        importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok")
""")


def import_blocked(*modules: str) -> subprocess.CompletedProcess:
    """Import `modules` in a fresh interpreter with BLOCKED blocked; it prints "ok" (exit
    0) only when they all imported and none of BLOCKED got loaded."""
    return subprocess.run([sys.executable, "-c", CHECK, *modules], capture_output=True,
                          text=True, timeout=120)
