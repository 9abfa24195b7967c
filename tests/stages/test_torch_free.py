"""The frontend never loads torch: web/app.py, the stages that run beside it (render,
detokenize, parse, account, emit), stages/api and the message modules import with torch,
triton and xgrammar blocked. A frontend process saves ~300 MB and a second or two."""
from tests.support.blocked_imports import import_blocked

MODULES = ("web.app", "stages.render", "stages.detokenize", "stages.parse", "stages.account",
           "stages.emit", "stages.messages", "stages.delta", "gpu.interface", "stages.api",
           "stages.api.common", "stages.api.chat", "stages.api.completions",
           "stages.api.responses", "stages.api.tokenize", "stages.api.framing",
           "stages.api.structured", "stages.api.tools", "stages.api.tool_parsers")


def test_frontend_imports_without_torch():
    done = import_blocked(*MODULES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_the_block_catches_torch():
    # the check itself can fail: a module that needs torch does not import
    done = import_blocked("gpu.worker.runner")
    assert done.returncode != 0 and "torch is blocked" in done.stderr
