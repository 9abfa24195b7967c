"""The house rules of docs/architecture.md, checked over the source (ast: nothing of the
code is imported, but for check 3, which runs in a subprocess of its own):

1. imports run one way, web -> pipeline -> stages -> gpu: every import of a higher layer
   by a lower one is an upward edge (a deferred import inside a function counts too: it
   is the same dependency, only paid later);
2. no module over MAX_LINES lines in pipeline/, stages/, web/ and gpu/;
3. stages.schedule imports with torch blocked (the scheduler is host code);
4. no import cycle spans two packages (a package: a folder with its __init__.py, such as
   pipeline/core or stages/api);
5. no import cycle inside a package at run time (an import under `if TYPE_CHECKING:` is
   not run, so it does not count here; a deferred one does);
6. stages/ imports of gpu/ only the contract (CONTRACT): the step plan and result, the
   torch-free model descriptions, the tokenizers and the LoRA registry.

    python scripts/check_house.py          # one line per violation; exit status 1 if any

tests/test_house.py runs it.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("web", "pipeline", "stages", "gpu")     # top first: each imports only those below it
SIZED = ("pipeline", "stages", "web", "gpu")
# What stages/ may import of gpu/ (a module, or a package and everything in it)
# (gpu.kv_transfer.side_channel: the torch-free wire protocol both halves of the KV connector
# speak, the request side's free message included)
CONTRACT = ("gpu.interface", "gpu.config", "gpu.tokenizers", "gpu.lora.spec",
            "gpu.kv_transfer.side_channel")
MAX_LINES = 600

TORCH_BLOCKED = textwrap.dedent("""
    import importlib, importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ImportError(f"{name} is blocked")
            return None

    sys.meta_path.insert(0, Block())
    importlib.import_module(sys.argv[1])
""")


@attrs.frozen
class Edge:
    source: str         # the importing module, dotted
    target: str         # the imported module, dotted (a module of ours)
    path: Path
    line: int
    type_only: bool = False     # under `if TYPE_CHECKING:`: never run


@attrs.frozen
class Module:
    name: str
    path: Path
    is_package: bool    # an __init__.py

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def layer(self) -> str:
        return self.name.split(".")[0]


def modules(root: Path = ROOT) -> dict[str, Module]:
    """Every module of the four layers, by dotted name."""
    found = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            found[name] = Module(name, path, is_package)
    return found


def imports(module: Module, known: dict[str, Module]) -> Iterator[Edge]:
    """The modules of ours that `module` imports, wherever the import statement is."""
    tree = ast.parse(module.path.read_text(), str(module.path))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        type_only = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _ours(alias.name, known)
                if target is not None:
                    yield Edge(module.name, target, module.path, node.lineno, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module)
            for alias in node.names:
                # `from a import b`: b is a submodule, or a name in a
                target = _ours(f"{base}.{alias.name}", known) if base else None
                if target is None or not target.endswith(f".{alias.name}"):
                    target = _ours(base, known)
                if target is not None:
                    yield Edge(module.name, target, module.path, node.lineno, type_only)


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def contract_breaches(edges: list[Edge], known: dict[str, Module]) -> list[Edge]:
    return [e for e in edges if known[e.source].layer == "stages" and known[e.target].layer == "gpu"
            and not any(e.target == c or e.target.startswith(c + ".") for c in CONTRACT)]


def _absolute(node: ast.ImportFrom, module: Module) -> str:
    if not node.level:
        return node.module or ""
    package = module.package.split(".")
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _ours(name: str, known: dict[str, Module]) -> str | None:
    """The longest prefix of `name` that is one of our modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def upward_edges(edges: list[Edge], known: dict[str, Module]) -> list[Edge]:
    rank = {layer: k for k, layer in enumerate(LAYERS)}
    return [e for e in edges
            if rank[known[e.target].layer] < rank[known[e.source].layer]]


def long_modules(known: dict[str, Module]) -> list[tuple[Path, int]]:
    out = []
    for m in known.values():
        if m.layer in SIZED:
            lines = len(m.path.read_text().splitlines())
            if lines > MAX_LINES:
                out.append((m.path, lines))
    return out


def cycles(edges: list[Edge], known: dict[str, Module], within: bool = False) -> list[list[str]]:
    """The strongly connected components of the import graph whose modules lie in more
    than one package (Tarjan's algorithm, iterative); within: those inside one package."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for e in edges:
        if e.target != e.source:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                spans = len({known[m].package for m in component}) > 1
                if (spans and not within) or (within and not spans and len(component) > 1):
                    components.append(sorted(component))
    return components


def imports_without_torch(module: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", TORCH_BLOCKED, module], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def violations(root: Path = ROOT) -> list[str]:
    """One line per broken rule (see the module's docstring); empty when the house holds."""
    known = modules(root)
    edges = sorted({e for m in known.values() for e in imports(m, known)},
                   key=lambda e: (e.source, e.line, e.target))
    out = []
    for e in upward_edges(edges, known):
        out.append(f"upward import: {e.path.relative_to(root)}:{e.line}: {e.source} imports "
                   f"{e.target} ({known[e.source].layer} -> {known[e.target].layer})")
    for path, lines in long_modules(known):
        out.append(f"long module: {path.relative_to(root)} has {lines} lines "
                   f"(at most {MAX_LINES})")
    done = imports_without_torch("stages.schedule", root)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        out.append(f"torch import: stages.schedule does not import with torch blocked: {last}")
    for component in cycles(edges, known):
        packages = sorted({known[m].package for m in component})
        out.append(f"import cycle across {', '.join(packages)}: {len(component)} modules: "
                   f"{', '.join(component)}")
    run_time = [e for e in edges if not e.type_only]
    for component in cycles(run_time, known, within=True):
        out.append(f"import cycle at run time inside {known[component[0]].package}: "
                   f"{', '.join(component)}")
    for e in contract_breaches(edges, known):
        out.append(f"contract: {e.path.relative_to(root)}:{e.line}: {e.source} imports {e.target} "
                   f"(stages/ import only {', '.join(CONTRACT)})")
    return out


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    print(f"check_house: {len(found)} violation{'s' * (len(found) != 1)}"
          if found else "check_house: the house holds")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
