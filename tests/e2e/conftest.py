"""pytest wiring for the real-vLLM end-to-end tests (see e2e_harness.py).

Run inside the e2e environment: ``.e2e/venv/bin/python -m pytest tests/e2e``
(after ``scripts/setup_e2e_env.sh``). Anywhere else every test here is skipped
with the reason. Engines are separate processes, kept per test module
(engine_pool.EnginePool); only one prefill/decode pair works at a time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_harness import (
    DEFAULT_PROMPT_LENGTHS,
    make_prompts,
    missing_env_reason,
    tiny_llama,
)

_REASON: list[str | None] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: runs real vLLM engines (needs scripts/setup_e2e_env.sh)")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Print each model family's TTFT comparison (NixlConnector and KVBridgeConnector,
    same run, same prompts) after the run, whether or not output was captured."""
    import sys

    families = sys.modules.get("families")
    figures = getattr(families, "FIGURES", None) if families else None
    if not figures:
        return
    terminalreporter.section("model families: decode TTFT, NixlConnector vs KVBridgeConnector")
    for family in figures:
        terminalreporter.write_line(families.comparison_text(family))


def _reason() -> str | None:
    if not _REASON:
        _REASON.append(missing_env_reason())
    return _REASON[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath))
        # test_harness_logic.py checks the harness's own logic and needs no engine.
        if path.parent == here and path.name != "test_harness_logic.py":
            item.add_marker(pytest.mark.e2e)
            reason = _reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


_WORKDIR = pytest.StashKey[Path]()
#: lines of each engine or router log written during a failed test that its report shows
LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's report (its body, or a fixture that set it up: an engine that did not
    start) ends with the tails of the served logs (engines, routers) written meanwhile: CI
    keeps only what the run printed, and the logs go with the machine."""
    outcome = yield
    rep = outcome.get_result()
    workdir = item.config.stash.get(_WORKDIR, None)
    if rep.when == "teardown" or not rep.failed or workdir is None:
        return
    for log in sorted(workdir.rglob("*.log")):
        try:
            if log.stat().st_mtime < call.start:
                continue
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            continue
        rep.sections.append((f"served log {log.relative_to(workdir)} (last {len(lines)} lines)",
                             "\n".join(lines)))


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    keep = os.environ.get("KVB_E2E_WORKDIR")
    if keep:
        p = Path(keep)
        p.mkdir(parents=True, exist_ok=True)
    else:
        p = tmp_path_factory.mktemp("e2e")
    request.config.stash[_WORKDIR] = p
    return p


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts(DEFAULT_PROMPT_LENGTHS, seed=1234)


@pytest.fixture(scope="session")
def model_kv2() -> Path:
    return tiny_llama(kv_heads=2)


@pytest.fixture(scope="session")
def model_kv4() -> Path:
    return tiny_llama(kv_heads=4)


# --------------------------------------------------------------------------- model families
# Class-scoped, for the family modules' Test<Family> classes (families.FamilyScenarios):
# the class names its family in ``family``.


@pytest.fixture(scope="class")
def fam_model(request: pytest.FixtureRequest) -> Path:
    from families import tiny_family_model

    return tiny_family_model(request.cls.family)


@pytest.fixture(scope="class")
def fam_prompts() -> list[list[int]]:
    from families import family_prompts

    return family_prompts()


@pytest.fixture(scope="class")
def fam_state() -> dict:
    """What one test of the class leaves for the next (baselines, a refusal)."""
    return {}


@pytest.fixture(scope="session")
def forker(e2e_workdir: Path) -> Iterator:
    """The session's fork server (forkserver.py): engines that may be forked from it start
    in seconds instead of re-importing vLLM. ``KVB_E2E_FORKSERVER=0`` turns it off (every
    engine is then a process of its own), as does a harness that runs in another Python
    than the e2e environment's (the server is a fork of the harness's interpreter); a
    server that fails to start is reported and left off."""
    from e2e_harness import e2e_python
    from forkserver import ForkServer

    if os.environ.get("KVB_E2E_FORKSERVER", "1") == "0" or _reason():
        yield None
        return
    if Path(str(e2e_python())).parent.parent.resolve() != Path(sys.prefix).resolve():
        print(f"\nfork server off: the harness runs in {sys.prefix}, not the e2e environment")
        yield None
        return
    server = ForkServer(e2e_workdir / "forkserver", os.environ)
    try:
        server.wait_ready()
    except RuntimeError as e:
        print(f"\nfork server off: {e}")
        server.close()
        yield None
        return
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="class")
def fam_pool(request: pytest.FixtureRequest, e2e_workdir: Path, forker) -> Iterator:
    from engine_pool import running_pool

    family = request.cls.family
    with running_pool(e2e_workdir / f"family-{family}", family, forker) as p:
        yield p


@pytest.fixture(scope="class")
def fam_nixl(request: pytest.FixtureRequest, fam_model: Path) -> dict:
    from families import FAMILIES, NIXL, engine_defs

    family = request.cls.family
    return engine_defs(FAMILIES[family], fam_model, NIXL, f"{family}-nixl")


@pytest.fixture(scope="class")
def fam_kvb(request: pytest.FixtureRequest, fam_model: Path) -> dict:
    from families import FAMILIES, KVBRIDGE, engine_defs

    family = request.cls.family
    return engine_defs(FAMILIES[family], fam_model, KVBRIDGE, f"{family}-kvbridge")
