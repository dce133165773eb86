"""KVBridgeConnector against ``KVConnectorBase_V1`` of every supported vLLM release.

Each release's ``base.py`` is read from its wheel on the package registry (a few
HTTP range requests, cached; see :mod:`vllm_release`) and parsed with :mod:`ast`,
as is the connector's own module: nothing imports vLLM, torch or CUDA. A release
that adds an abstract method, renames a parameter or changes a hook's kind shows up
here, in CI, before a user meets it. The base's other methods the connector does
not override are printed (``pytest -rP``): vLLM's defaults apply to them.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest
from vllm_release import ReleaseUnavailable, release_file

#: the vLLM releases kvbridge supports (README.md and docs/vllm.md name them)
SUPPORTED_VLLM = ("0.32.0", "0.33.0")
BASE_PATH = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CONNECTOR = pathlib.Path(__file__).parents[1] / "src" / "kvbridge" / "vllm" / "connector.py"
#: base methods with a default the connector must not inherit, and why
REQUIRED_OVERRIDES = {
    "supports_sleep_mode": "vLLM 0.33's default answers True; the connector must say whether "
                           "its NIXL registrations can follow the cache through sleep mode",
    "unregister_kv_caches": "sleep mode frees the cache: NIXL must drop its registrations first",
    "restore_kv_caches": "after wake-up the cache must be registered again and peers told",
    "request_finished": "a prefill request's blocks are held until the decode side read them",
    "get_finished": "finished sends and receives are reported per rank",
    "register_kv_caches": "the cache is registered with NIXL",
    "get_handshake_metadata": "each rank publishes its NIXL metadata",
    "set_xfer_handshake_metadata": "the scheduler serves every rank's metadata",
}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # posonly | positional | vararg | kwonly | varkw
    has_default: bool


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # instance | classmethod | staticmethod | property
    abstract: bool
    params: tuple[Param, ...]

    def show(self) -> str:
        return f"{self.kind} {self.name}({', '.join(p.name for p in self.params)})"


def _method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decos = {ast.unparse(d).rsplit(".", 1)[-1] for d in fn.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos), "instance")
    a = fn.args
    params: list[Param] = []
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        params.append(Param(arg.arg, "posonly" if i < len(a.posonlyargs) else "positional",
                            i >= first_default))
    if a.vararg is not None:
        params.append(Param(a.vararg.arg, "vararg", True))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(Param(arg.arg, "kwonly", default is not None))
    if a.kwarg is not None:
        params.append(Param(a.kwarg.arg, "varkw", True))
    if kind in ("instance", "classmethod", "property") and params:
        params = params[1:]  # self / cls
    return Method(fn.name, kind, "abstractmethod" in decos, tuple(params))


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, Method]:
    return {n.name: _method(n) for n in cls.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def incompatibilities(base: Method, impl: Method) -> list[str]:
    """Why a call made as ``base`` declares it could fail on ``impl`` (empty: compatible).

    vLLM may pass any parameter by position or by name, so positional parameters must
    match name for name in order; parameters the base may omit must have defaults;
    parameters ``impl`` adds must have defaults (or be ``*args``/``**kwargs``)."""
    out = []
    if base.kind != impl.kind:
        out.append(f"is {impl.kind}, the base's is {base.kind}")
    pos_b = [p for p in base.params if p.kind in ("posonly", "positional")]
    pos_i = [p for p in impl.params if p.kind in ("posonly", "positional")]
    kinds_i = {p.kind for p in impl.params}
    by_name_i = {p.name: p for p in impl.params}
    for i, pb in enumerate(pos_b):
        if i >= len(pos_i):
            if "vararg" not in kinds_i:
                out.append(f"takes no positional parameter {pb.name!r} (#{i + 1})")
            continue
        pi = pos_i[i]
        if pi.name != pb.name and pb.kind == "positional":
            out.append(f"names positional parameter #{i + 1} {pi.name!r}, the base {pb.name!r}")
        if pb.has_default and not pi.has_default:
            out.append(f"parameter {pi.name!r} needs a default (the base's may be omitted)")
    for pi in pos_i[len(pos_b):]:
        if not pi.has_default:
            out.append(f"adds parameter {pi.name!r} without a default")
    for pb in (p for p in base.params if p.kind == "kwonly"):
        pi = by_name_i.get(pb.name)
        if pi is None or pi.kind not in ("positional", "kwonly"):
            if "varkw" not in kinds_i:
                out.append(f"lacks keyword parameter {pb.name!r}")
        elif pb.has_default and not pi.has_default:
            out.append(f"parameter {pi.name!r} needs a default (the base's may be omitted)")
    names_b = {p.name for p in base.params}
    for pi in (p for p in impl.params if p.kind == "kwonly"):
        if pi.name not in names_b and not pi.has_default:
            out.append(f"adds keyword parameter {pi.name!r} without a default")
    for k in ("vararg", "varkw"):
        if any(p.kind == k for p in base.params) and k not in kinds_i:
            out.append(f"lacks the base's {'*args' if k == 'vararg' else '**kwargs'}")
    return out


def _base_methods(version: str) -> dict[str, Method]:
    try:
        source = release_file(version, BASE_PATH)
    except ReleaseUnavailable as exc:
        pytest.skip(f"vLLM {version}'s {BASE_PATH} is not available offline: {exc}")
    classes = _classes(source)
    assert "KVConnectorBase_V1" in classes, f"vLLM {version} has no KVConnectorBase_V1 in {BASE_PATH}"
    methods = dict(_methods(classes["SupportsHMA"])) if "SupportsHMA" in classes else {}
    methods.update(_methods(classes["KVConnectorBase_V1"]))
    return methods


def _connector_methods() -> dict[str, Method]:
    return _methods(_classes(CONNECTOR.read_text(encoding="utf-8"))["KVBridgeConnector"])


@pytest.mark.parametrize("version", SUPPORTED_VLLM)
def test_the_connector_implements_the_base_of_each_supported_release(version: str) -> None:
    base, ours = _base_methods(version), _connector_methods()
    problems = []
    for name, m in sorted(base.items()):
        if name.startswith("_") and name != "__init__":
            continue
        if name not in ours:
            if m.abstract:
                problems.append(f"abstract {m.show()} is not implemented")
            elif name in REQUIRED_OVERRIDES:
                problems.append(f"{m.show()} is inherited: {REQUIRED_OVERRIDES[name]}")
            continue
        problems.extend(f"{name}: {why} (vLLM {version}: {m.show()})"
                        for why in incompatibilities(m, ours[name]))
    assert not problems, f"KVBridgeConnector against vLLM {version}'s KVConnectorBase_V1:\n  " + \
        "\n  ".join(problems)
    inherited = sorted(m.show() for n, m in base.items()
                       if n not in ours and not n.startswith("_"))
    extra = sorted(n for n in ours if n not in base and not n.startswith("_"))
    print(f"vLLM {version}: {len(base)} base methods, {len(inherited)} inherited with vLLM's "
          f"default:\n  " + "\n  ".join(inherited))
    print(f"connector methods vLLM {version}'s base does not have: {extra}")


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@pytest.mark.parametrize("version", SUPPORTED_VLLM)
def test_what_the_connector_imports_and_builds_from_the_base_exists(version: str) -> None:
    """The names connector.py imports from base.py (an ImportError would stop vLLM from
    loading the connector), and the fields it fills in ``KVConnectorTransferResults``."""
    try:
        base = ast.parse(release_file(version, BASE_PATH))
    except ReleaseUnavailable as exc:
        pytest.skip(f"vLLM {version}'s {BASE_PATH} is not available offline: {exc}")
    ours = ast.parse(CONNECTOR.read_text(encoding="utf-8"))
    module = BASE_PATH.removesuffix(".py").replace("/", ".")
    imported = {a.name for n in ast.walk(ours) if isinstance(n, ast.ImportFrom) and n.module == module
                for a in n.names}
    assert {"KVConnectorBase_V1", "SupportsHMA"} <= imported
    missing = imported - _top_level_names(base)
    assert not missing, f"vLLM {version}'s {BASE_PATH} lacks {sorted(missing)}"
    results = next(c for c in base.body if isinstance(c, ast.ClassDef)
                   and c.name == "KVConnectorTransferResults")
    fields = {n.target.id for n in results.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    passed = {k.arg for n in ast.walk(ours) if isinstance(n, ast.Call)
              and ast.unparse(n.func).endswith("KVConnectorTransferResults") for k in n.keywords}
    assert passed and passed <= fields, (passed, fields)


def test_every_required_override_exists_in_some_release() -> None:
    """A name in REQUIRED_OVERRIDES that no supported release has is a typo or a hook
    vLLM removed: either way the list must change."""
    names: set[str] = set()
    for version in SUPPORTED_VLLM:
        names |= set(_base_methods(version))
    assert set(REQUIRED_OVERRIDES) <= names, set(REQUIRED_OVERRIDES) - names


def _m(src: str, kind: str = "instance") -> Method:
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    m = _method(fn)
    return Method(m.name, kind if kind != "instance" else m.kind, m.abstract, m.params)


@pytest.mark.parametrize(("impl", "expected"), [
    ("def f(self, a, b=1): pass", []),
    ("def f(self, a, b=1, c=2, *, d=3, **kw): pass", []),
    ("def f(self, x, b=1): pass", ["names positional parameter #1 'x', the base 'a'"]),
    ("def f(self, a, b): pass", ["parameter 'b' needs a default (the base's may be omitted)"]),
    ("def f(self, a): pass", ["takes no positional parameter 'b' (#2)"]),
    ("def f(self, a, b=1, *, e): pass", ["adds keyword parameter 'e' without a default"]),
])
def test_the_signature_check_refuses_what_a_caller_would_trip_on(impl: str, expected: list[str]
                                                                 ) -> None:
    base = _m("def f(self, a, b=1): pass")
    assert incompatibilities(base, _m(impl)) == expected


def test_the_signature_check_sees_kind_and_keyword_changes() -> None:
    base = _m("@classmethod\ndef f(cls, a, *, k=0, **kw): pass")
    assert incompatibilities(base, _m("@classmethod\ndef f(cls, a, *, k=0, **kw): pass")) == []
    assert incompatibilities(base, _m("def f(self, a, *, k=0, **kw): pass")) == [
        "is instance, the base's is classmethod"]
    assert incompatibilities(_m("def f(self, a): pass"), _m("def f(self, a, c): pass")) == [
        "adds parameter 'c' without a default"]
    assert incompatibilities(base, _m("@classmethod\ndef f(cls, a, **kw): pass")) == []
    assert incompatibilities(base, _m("@classmethod\ndef f(cls, a, *, k=0): pass")) == [
        "lacks the base's **kwargs"]
