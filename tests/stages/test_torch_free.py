"""The frontend never loads torch: web/app.py, the stages that run beside it (render,
detokenize, parse, account, emit), stages/api and the message modules import with torch,
triton and xgrammar blocked. A frontend process saves ~300 MB and a second or two."""
import subprocess
import sys
import textwrap

MODULES = ("web.app", "stages.render", "stages.detokenize", "stages.parse", "stages.account",
           "stages.emit", "stages.messages", "stages.lib.delta", "gpu.interface", "stages.api",
           "stages.api.common", "stages.api.chat", "stages.api.completions",
           "stages.api.responses", "stages.api.tokenize", "stages.api.framing",
           "stages.api.structured", "stages.api.tools", "stages.api.tool_parsers")

_CHECK = textwrap.dedent("""
    import importlib, importlib.abc, sys

    BLOCKED = ("torch", "triton", "xgrammar")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the frontend must not import it")
            return None

    sys.meta_path.insert(0, Block())
    for name in sys.argv[1:]:
        importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok")
""")


def _import_blocked(*modules: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHECK, *modules], capture_output=True,
                          text=True, timeout=120)


def test_frontend_imports_without_torch():
    done = _import_blocked(*MODULES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_the_block_catches_torch():
    # the check itself can fail: a module that needs torch does not import
    done = _import_blocked("gpu.runner")
    assert done.returncode != 0 and "torch is blocked" in done.stderr
