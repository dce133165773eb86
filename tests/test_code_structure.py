"""The structure of kvbridge: no import cycles, package boundaries kept, small modules.

Reads every module under packages/*/src with :mod:`ast` (nothing is imported)
and collects the edges module -> kvbridge module it imports (function-local and
``TYPE_CHECKING`` imports included: a cycle hidden inside a function is still a
cycle). Fails naming every import cycle, and every import of another kvbridge
package that is not declared in the importer's pyproject, points up the stack
(topology < memory < handshake < nixl < vllm) or reaches past the other
package's top level (``kvbridge.topology.cli`` instead of ``kvbridge.topology``).
Also fails on modules over 500 lines, on any use of an underscore member of an
object other than ``self``/``cls`` (``engine._loads``: give the object a public
method instead), and on runtime code importing the development tools
(``kvbridge.tools``, ``kvbridge.nixl.testing``).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_name(path: pathlib.Path) -> str:
    src = next(p for p in path.parents if p.name == "src")
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.glob("packages/*/src/kvbridge/**/*.py"))}


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """``name`` itself when it is a module, else its parent (``from pkg.mod import Name``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(mod: str, path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, absolute module or name)`` of every import in a module, function-local and
    ``TYPE_CHECKING`` ones included (``from pkg import name`` gives ``pkg`` and ``pkg.name``)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out += [(node.lineno, prefix)] + [(node.lineno, f"{prefix}.{a.name}") for a in node.names]
    return out


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        # `from pkg import mod` names a module; `from mod import Name` names the module
        for _, t in imported_names(mod, path):
            if not t.startswith("kvbridge."):
                continue
            dep = _resolve(t, modules)
            if dep is not None and dep != mod and not mod.startswith(dep + "."):
                graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "packages" / "demo" / "src" / "kvbridge" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from kvbridge.demo import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    mods = {_module_name(p): p for p in sorted(tmp_path.glob("packages/*/src/kvbridge/**/*.py"))}
    assert find_cycles(import_graph(mods)) == [["kvbridge.demo.a", "kvbridge.demo.b"]]


PACKAGES = sorted(p.name for p in ROOT.glob("packages/*") if (p / "src" / "kvbridge").is_dir())
@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles_through_a_package(package):
    modules = _modules()
    assert f"kvbridge.{package}" in modules
    cycles = [c for c in find_cycles(import_graph(modules))
              if any(m == f"kvbridge.{package}" or m.startswith(f"kvbridge.{package}.") for m in c)]
    assert not cycles, "import cycles (break each by moving the shared piece): " + "; ".join(
        " <-> ".join(c) for c in cycles)


#: the stack: a package may import only packages to its left
ORDER = ["topology", "memory", "handshake", "nixl", "vllm"]
#: what each package may import: the stack below it; the router stands alone; the development
#: tools (demo, bench, harness) sit on the transfer engine, and nothing imports them
ALLOWED = {**{p: ORDER[:i] for i, p in enumerate(ORDER)}, "router": [], "tools": ORDER[:4]}
def _declared(package: str) -> set[str]:
    text = (ROOT / "packages" / package / "pyproject.toml").read_text("utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]  # the [project] table only
    found = re.search(r"^dependencies\s*=\s*(\[.*?\])", project, re.M | re.S)
    names = set()
    for dep in ast.literal_eval(found.group(1)) if found else []:
        name = dep.split(";")[0].strip()
        for stop in "<>=!~[ ":
            name = name.split(stop)[0]
        if name.startswith("kvbridge-"):
            names.add(name.removeprefix("kvbridge-"))
    return names


def boundary_breaches(package: str, modules: dict[str, pathlib.Path]) -> list[str]:
    """Every import in ``package`` of another kvbridge package that breaks the rules above."""
    own = f"kvbridge.{package}"
    declared = _declared(package)
    out = []
    for mod, path in sorted(modules.items()):
        if mod != own and not mod.startswith(own + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "kvbridge" or len(parts) < 2 or parts[1] == package:
                    continue
                other = parts[1]
                where = f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                if other not in ALLOWED.get(package, ()):
                    out.append(f"{where}: kvbridge-{package} may not depend on kvbridge-{other}")
                elif other not in declared:
                    out.append(f"{where}: kvbridge-{other} is not in kvbridge-{package}'s "
                               f"dependencies")
                if len(parts) > 2:
                    out.append(f"{where}: import from kvbridge.{other} itself (its public API)")
    return out


def test_the_boundary_checker_names_each_breach(tmp_path, monkeypatch):
    for name, deps, code in (("topology", [], ""), ("memory", ["kvbridge-topology"],
                             "from kvbridge.topology.plan import plan_rank\n"
                             "import kvbridge.handshake\n")):
        pkg = tmp_path / "packages" / name
        (pkg / "src" / "kvbridge" / name).mkdir(parents=True)
        (pkg / "src" / "kvbridge" / name / "__init__.py").write_text(code)
        (pkg / "pyproject.toml").write_text(f"[project]\nname = 'kvbridge-{name}'\n"
                                            f"dependencies = {deps!r}\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    mods = {_module_name(p): p for p in sorted(tmp_path.glob("packages/*/src/kvbridge/**/*.py"))}
    got = boundary_breaches("memory", mods)
    assert len(got) == 2
    assert "kvbridge.topology.plan" in got[0] and "its public API" in got[0]
    assert "may not depend on kvbridge-handshake" in got[1]
    assert boundary_breaches("topology", mods) == []


def test_every_package_has_a_boundary_rule():
    assert sorted(ALLOWED) == PACKAGES, "add the new package to ORDER or ALLOWED"


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_declared_siblings_below_it(package):
    breaches = boundary_breaches(package, _modules())
    assert not breaches, "\n".join(breaches)


#: a module is one concept: past this size, split it along its concepts
MAX_LINES = 500


def test_no_module_is_over_the_size_limit():
    sizes = {m: len(p.read_text("utf-8").splitlines()) for m, p in _modules().items()}
    assert len(sizes) > 50
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


# ---------------------------------------------------------------------------
# no reach-through into another object's private members


def private_reaches(source: str, filename: str = "<snippet>") -> list[str]:
    """Every use in ``source`` of an underscore member of an object other than ``self``,
    ``cls`` or ``super()``: ``x._name`` and ``getattr``/``setattr``/``hasattr``/``delattr``
    ``(x, "_name")``, as ``"line: expression"``. Dunder names (``__init__``) are not private."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    def own(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")

    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and private(node.attr) and not own(node.value):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(node.args[1].value) and not own(node.args[0])):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda r: int(r.split(":")[0]))


#: the only reach-throughs allowed, by module and expression, and why: into third-party
#: objects that offer no public way (never into kvbridge's own objects)
REACH_THROUGH_ALLOWED = {
    "kvbridge.vllm.shims": {
        "request._all_token_ids": "vLLM's Request has no public way to drop the last prompt "
                                  "token that a decode engine must compute itself",
    },
}


def test_the_reach_through_checker_finds_private_members_of_other_objects():
    snippet = (
        "class A:\n"
        "    def f(self, other, engine):\n"
        "        self._mine = cls._too = super()._base()\n"
        "        self.engine._loads.pop(1)\n"
        "        other._fail('x')\n"
        "        x = other.__class__, other.__dict__, engine.public\n"
        "        getattr(engine, '_events').put(1)\n"
        "        return getattr(self, '_ok'), hasattr(engine, '__len__'), module._private\n"
    )
    assert private_reaches(snippet) == [
        "4: self.engine._loads", "5: other._fail", "7: getattr(engine, '_events')",
        "8: module._private",
    ]


def test_no_module_reaches_into_another_objects_private_members():
    found = {}
    for mod, path in _modules().items():
        allowed = REACH_THROUGH_ALLOWED.get(mod, {})
        reaches = [r for r in private_reaches(path.read_text("utf-8"), str(path))
                   if r.split(": ", 1)[1] not in allowed]
        if reaches:
            found[str(path.relative_to(ROOT))] = reaches
    assert not found, (
        "modules use underscore members of objects other than self/cls (give the other object "
        "a public method or attribute for it): " + "; ".join(f"{p}: {r}" for p, r in found.items()))


@pytest.mark.parametrize("mod", sorted(REACH_THROUGH_ALLOWED))
def test_every_reach_through_exception_is_still_needed(mod):
    path = _modules()[mod]
    used = {r.split(": ", 1)[1] for r in private_reaches(path.read_text("utf-8"))}
    assert set(REACH_THROUGH_ALLOWED[mod]) <= used, (
        f"{mod} no longer uses {sorted(set(REACH_THROUGH_ALLOWED[mod]) - used)}: remove it from "
        "REACH_THROUGH_ALLOWED")


# ---------------------------------------------------------------------------
# runtime code never imports the development tools

#: modules that hold development tools (demo, bench, harness, synthetic caches)
TOOLS = ("kvbridge.tools", "kvbridge.nixl.testing")


def tools_imports(modules: dict[str, pathlib.Path]) -> list[str]:
    """Every import of a tools module (:data:`TOOLS`) by a module that is not one itself."""

    def is_tool(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t in TOOLS)

    out = []
    for mod, path in sorted(modules.items()):
        if is_tool(mod):
            continue
        for line, name in imported_names(mod, path):
            if is_tool(name):
                out.append(f"{mod} (line {line}) imports {name}")
    return sorted(set(out))


def test_the_tools_checker_finds_runtime_imports_of_the_tools(tmp_path):
    src = tmp_path / "src" / "kvbridge"
    for rel, code in {
        "nixl/__init__.py": "",
        "nixl/decode.py": "def f():\n    from .testing import harness\n",
        "nixl/peers.py": "from kvbridge.nixl import testing\n",
        "nixl/testing/__init__.py": "from . import harness\nimport kvbridge.tools.bench\n",
        "nixl/testing/harness.py": "",
        "vllm/worker.py": "import kvbridge.tools\nfrom kvbridge.nixl import DecodeEngine\n",
        "tools/bench.py": "from kvbridge.nixl.testing import harness\n",
    }.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(code)
    mods = {_module_name(p): p for p in sorted(src.rglob("*.py"))}
    assert tools_imports(mods) == [
        "kvbridge.nixl.decode (line 2) imports kvbridge.nixl.testing",
        "kvbridge.nixl.decode (line 2) imports kvbridge.nixl.testing.harness",
        "kvbridge.nixl.peers (line 1) imports kvbridge.nixl.testing",
        "kvbridge.vllm.worker (line 1) imports kvbridge.tools",
    ]


def test_runtime_code_never_imports_the_tools():
    modules = _modules()
    assert "kvbridge.nixl.decode" in modules and "kvbridge.vllm.pull.worker" in modules
    leaks = tools_imports(modules)
    assert not leaks, ("runtime modules import development tools (move what they need into the "
                       "runtime package, or the code into the tools): " + "; ".join(leaks))
