"""How the tests import (issue 54), checked over the source with ast, as scripts/check_house.py
checks the code: what tests share lives in tests/support and is imported as
``tests.support.<module>`` (pyproject.toml's pytest ``pythonpath`` puts the repo root on
sys.path). So no file under tests/ edits sys.path, and none imports a test module, a
conftest, or a helper by its bare name (which works only through the folder pytest's
"prepend" import mode put on sys.path) or relatively. And the check itself catches each kind."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = "tests.support"


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement names: `from . import x` as `.x`, `from .a import b` as `.a`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.module is None:     # from . import x, y
            return ["." * node.level + a.name for a in node.names]
        return ["." * node.level + node.module]
    return []


def _edits_sys_path(node: ast.AST) -> bool:
    """sys.path.insert/append/extend/remove(...), sys.path[...] = or sys.path = / +=."""
    def is_sys_path(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
                and n.value.id == "sys")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("insert", "append", "extend", "remove") and is_sys_path(node.func.value)
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    return any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets)


def violations(tests: Path) -> list[str]:
    """One line per sys.path edit and per import of a test module, a conftest, or a module of
    tests/ by any name but tests.support.<module>, in the .py files under `tests`."""
    files = sorted(tests.rglob("*.py"))
    local = {p.stem for p in files} - {"__init__"}       # what a bare import would reach here
    found: list[tuple[Path, int, str]] = []
    for path in files:
        where = path.relative_to(tests.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _edits_sys_path(node):
                found.append((where, node.lineno, "edits sys.path"))
            for name in _imported(node):
                parts = name.lstrip(".").split(".")
                if name.startswith("."):
                    why = "a relative import"
                elif parts[0] == "tests" and name != SUPPORT and not name.startswith(SUPPORT + "."):
                    why = "a module of tests/ outside tests/support"
                elif parts[0] == "tests" or parts[0] not in local:
                    continue
                else:
                    why = "a module of tests/ by its bare name"
                if any(p.startswith("test_") or p == "conftest" for p in parts):
                    why = "a conftest" if parts[-1] == "conftest" else "a test module"
                found.append((where, node.lineno, f"imports {name} ({why})"))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def test_tests_import_only_tests_support_and_leave_sys_path_alone():
    found = violations(TESTS)
    assert found == [], "\n".join(found) + "\n(shared helpers belong in tests/support)"


def test_the_check_sees_each_kind(tmp_path):
    tests = tmp_path / "tests"
    files = {
        "support/helpers.py": "import json\nfrom tests.support.other import x\n",   # fine
        "support/other.py": "x = 1\n",
        "conftest.py": "import pytest\n",
        "a/test_one.py": ("import sys\nfrom tests.support import helpers\n"
                          "from tests.support.helpers import json\n"),             # fine
        "a/test_two.py": ("import sys\n"
                          "sys.path.insert(0, 'x')\n"
                          "def f():\n    sys.path.append('y')\n    sys.path[:0] = ['z']\n"
                          "import test_one\n"
                          "from test_one import f\n"
                          "from tests.a.test_one import f\n"
                          "from tests.conftest import pytest\n"
                          "from helpers import json\n"
                          "from .test_one import f\n"
                          "from . import test_one\n"
                          "import os.path\n"),                                      # fine
    }
    for name, text in files.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    assert violations(tests) == [
        "tests/a/test_two.py:2: edits sys.path",
        "tests/a/test_two.py:4: edits sys.path",
        "tests/a/test_two.py:5: edits sys.path",
        "tests/a/test_two.py:6: imports test_one (a test module)",
        "tests/a/test_two.py:7: imports test_one (a test module)",
        "tests/a/test_two.py:8: imports tests.a.test_one (a test module)",
        "tests/a/test_two.py:9: imports tests.conftest (a conftest)",
        "tests/a/test_two.py:10: imports helpers (a module of tests/ by its bare name)",
        "tests/a/test_two.py:11: imports .test_one (a test module)",
        "tests/a/test_two.py:12: imports .test_one (a test module)",
    ]
