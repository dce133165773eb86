"""The package's shape: modules stay small, imports form no cycle, run time never imports testing."""

from __future__ import annotations

import ast
import pathlib

import kvbridge.nixl

ROOT = pathlib.Path(kvbridge.nixl.__file__).parent
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("kvbridge.nixl", *parts))] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every kvbridge.nixl module ``name`` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found.update(c for c in candidates if c in known and c != name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_module_is_over_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert len(sizes) > 10
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_imports_form_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_runtime_modules_never_import_testing():
    graph = _graph()
    runtime = [n for n in graph if not n.startswith("kvbridge.nixl.testing")]
    assert "kvbridge.nixl.decode" in runtime and "kvbridge.nixl.testing.harness" in graph
    leaks = {n: sorted(d for d in graph[n] if d.startswith("kvbridge.nixl.testing")) for n in runtime}
    assert {n: d for n, d in leaks.items() if d} == {}
