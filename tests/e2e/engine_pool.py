"""Long-lived vLLM engines for the end-to-end tests: started once, reused by many scenarios.

An engine start costs 20-60 s on two shared cores; a scenario (a batch of prompts
through a prefill and a decode engine) well under a few seconds. So a test module
keeps its engines in an :class:`EnginePool` (a module-scoped fixture) and every
test runs its scenario on them:

* :class:`Engine` is one ``engine_runner.py --serve`` process: the harness sends it
  commands (generate these prompts with these ``kv_transfer_params``, report
  metrics, flush) on stdin and reads each answer from a reply file.
* :func:`local_tokens` is the non-disaggregated run: the decode engine itself,
  no ``kv_transfer_params`` (same process, same weights, so the tokens a transfer
  gives must be identical to these).
* :func:`pd_round` runs one prefill/decode hand-over (pull, push, or pull after the
  prefill engine was killed) and returns a :class:`~e2e_harness.DisaggRun` whose
  metrics and logs cover that scenario only (snapshots and log offsets around it),
  so the checks of ``e2e_harness`` apply unchanged.
* :meth:`EnginePool.use` keeps only the engines a scenario names alive: a negative
  control swaps in another prefill engine and keeps the decode engine.

Engines run with an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
unless their :class:`~e2e_harness.EngineConfig` says otherwise: that starts faster,
and an idle engine (between commands) then runs nothing at all, so engines kept
for later scenarios cost memory, not CPU. TP 2 workers still run as processes;
vLLM's shared-memory queue puts them to sleep after a second without work.

Like ``e2e_harness``, this module imports neither vLLM nor torch, and knows no
connector: every ``kv_transfer_params`` dict it sends comes from the connector's
own answer (pull) or from :meth:`ConnectorUnderTest` data (push ids).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_harness import (
    RUNNER,
    ConnectorUnderTest,
    DisaggRun,
    EngineConfig,
    EngineFailed,
    e2e_python,
    free_port,
    missing_env_reason,
    stop_process_group,
)
from forkserver import ForkServer, forkable

HOST = "127.0.0.1"
START_DEADLINE_S = 900.0
COMMAND_DEADLINE_S = 900.0


@dataclass(frozen=True)
class EngineDef:
    """What an engine is: the pool reuses a running engine only for an equal definition.

    ``role`` is "prefill" or "decode" (with ``connector``) or "local" (no connector).
    """

    name: str
    model: Path
    role: str
    connector: ConnectorUnderTest | None = None
    config: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "local"):
            raise ValueError(f"role must be prefill, decode or local, got {self.role!r}")
        if (self.role == "local") != (self.connector is None):
            raise ValueError("a prefill or decode engine needs a connector; a local one has none")


class Engine:
    """One long-lived ``engine_runner.py --serve`` process in its own session."""

    def __init__(self, d: EngineDef, workdir: Path, python: str | None = None,
                 forker: ForkServer | None = None) -> None:
        self.d = d
        self.forker = forker
        self.name = d.name
        self.python = python or e2e_python()
        if self.python is None:
            raise RuntimeError(missing_env_reason() or "no e2e python")
        self.ctrl = workdir / d.name
        shutil.rmtree(self.ctrl, ignore_errors=True)
        self.ctrl.mkdir(parents=True)
        self.log_path = self.ctrl / "engine.log"
        self.port = free_port()  # the connector's side channel
        init: dict[str, Any] = {"name": d.name, "model": str(d.model), "ctrl_dir": str(self.ctrl),
                                "engine": d.config.llm_kwargs()}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1",
               **d.config.env()}
        if d.connector is not None:
            init["kv_transfer_config"] = d.connector.kv_transfer_config(d.role, HOST, self.port)
            env.update(d.connector.engine_env(HOST, self.port))
        self.init_path = self.ctrl / "init.json"
        self.init_path.write_text(json.dumps(init))
        self.env = env
        self.proc: Any = None  # subprocess.Popen or forkserver.ForkedProcess
        self.forked = False
        self.seq = 0
        self.ready: dict[str, Any] = {}
        self.started_at = 0.0
        self.ready_s: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        """A child of the fork server when it may be one (vLLM already imported there),
        else a process of its own."""
        argv = [str(self.python), str(RUNNER), "--serve", str(self.init_path)]
        self.started_at = time.monotonic()
        if self.forker is not None and self.forker.alive() and forkable(self.env, self.forker.env):
            self.proc = self.forker.spawn(argv, self.env, self.ctrl, self.log_path)
            self.forked = True
            return self
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log,
                                     stderr=subprocess.STDOUT, env=self.env, cwd=self.ctrl,
                                     start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> Engine:
        self._wait_file(self.ctrl / "ready.json", deadline_s, "engine start")
        self.ready = json.loads((self.ctrl / "ready.json").read_text())
        self.ready_s = time.monotonic() - self.started_at
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the runner to exit, then stop its process group (workers included)."""
        if self.proc is None:
            return
        if self.alive():
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of input ends the serve loop
            except OSError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        stop_process_group(self.proc, grace_s=grace_s)

    def freeze(self, seconds: float) -> threading.Thread:
        """Stop the engine's process group (SIGSTOP) and continue it (SIGCONT) ``seconds``
        later, from the returned thread; join it to be sure the engine runs again."""
        pid = self.proc.pid
        os.killpg(pid, signal.SIGSTOP)

        def thaw() -> None:
            time.sleep(seconds)
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

        t = threading.Thread(target=thaw, name=f"thaw-{self.name}", daemon=True)
        t.start()
        return t

    def kill(self) -> None:
        """SIGKILL at once (the dead-prefill scenario)."""
        if self.proc is not None:
            stop_process_group(self.proc, signal.SIGKILL, 0.0)

    # ------------------------------------------------------------------ commands

    def send(self, op: str, **args: Any) -> int:
        if not self.alive():
            raise EngineFailed(f"{self.name} is not running (exit {self.exit_code()})\n{self.log_tail()}")
        self.seq += 1
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"seq": self.seq, "op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self.seq

    def wait(self, seq: int, deadline_s: float = COMMAND_DEADLINE_S,
             others: Sequence[Engine] = ()) -> dict[str, Any]:
        path = self.ctrl / f"reply_{seq}.json"
        self._wait_file(path, deadline_s, f"command {seq}", others)
        reply = json.loads(path.read_text())
        if "error" in reply:
            raise EngineFailed(f"{self.name}: command {seq} ({reply.get('op')}) failed: "
                               f"{reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def call(self, op: str, deadline_s: float = COMMAND_DEADLINE_S, **args: Any) -> dict[str, Any]:
        return self.wait(self.send(op, **args), deadline_s)

    def metrics(self) -> list[dict[str, Any]]:
        return self.call("metrics", 120)["metrics"]

    def _wait_file(self, path: Path, deadline_s: float, what: str,
                   others: Sequence[Engine] = ()) -> None:
        end = time.monotonic() + deadline_s
        while not path.exists():
            dead = [e for e in (self, *others) if not e.alive()]
            if dead or time.monotonic() > end:
                why = (f"{dead[0].name} exited with {dead[0].exit_code()}" if dead
                       else f"deadline of {deadline_s:.0f} s passed")
                tails = "\n".join(f"----- {e.name} -----\n{e.log_tail()}" for e in (self, *others))
                raise EngineFailed(f"{self.name}: waiting for {what}: {why}\n{tails}")
            time.sleep(0.02)

    # ------------------------------------------------------------------ logs

    def log_offset(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_since(0).splitlines()[-n:])


class EnginePool:
    """The engines of one test module; :meth:`use` keeps only a scenario's engines alive."""

    def __init__(self, workdir: Path, python: str | None = None,
                 forker: ForkServer | None = None) -> None:
        self.workdir = workdir
        self.python = python
        self.forker = forker
        self.engines: dict[str, Engine] = {}
        #: (name, seconds to start, forked) of each engine start, in start order
        self.start_times: list[tuple[str, float, bool]] = []

    def use(self, *defs: EngineDef, keep: Iterable[str] = ()) -> list[Engine]:
        """Running engines for ``defs`` (reused when alive with an equal definition).

        Every other engine is stopped, except those named in ``keep`` (idle engines
        that a later scenario of the module needs: they cost memory, not CPU).
        Engines start one after another when their workers together exceed this
        host's cores (a starting engine starved by another's start took minutes),
        else at the same time.
        """
        names = {d.name for d in defs} | set(keep)
        for name in list(self.engines):
            e = self.engines[name]
            wanted = next((d for d in defs if d.name == name), None)
            if name not in names or not e.alive() or (wanted is not None and wanted != e.d):
                e.stop()
                del self.engines[name]
        new = [Engine(d, self.workdir, self.python, self.forker) for d in defs
               if d.name not in self.engines]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        together = sum(e.d.config.tp for e in new) <= cores
        try:
            if together:
                for e in new:
                    e.start()
            for e in new:
                if not together:
                    e.start()
                e.wait_ready()
                self.start_times.append((e.name, e.ready_s or 0.0, e.forked))
        except BaseException:
            for e in new:
                e.stop(grace_s=2.0)
            raise
        for e in new:
            self.engines[e.name] = e
        return [self.engines[d.name] for d in defs]

    def round(self, prefill: Engine, decode: Engine, prompts: list[list[int]], max_tokens: int,
              **kw: Any) -> DisaggRun:
        """:func:`pd_round`; engines of a round that raised are stopped, so that the next
        scenario starts fresh ones rather than inherit a half-done batch."""
        try:
            return pd_round(prefill, decode, prompts, max_tokens, **kw)
        except BaseException:
            self.discard(prefill, decode)
            raise

    def discard(self, *engines: Engine) -> None:
        """Stop engines a failed scenario may have left in a bad state."""
        for e in engines:
            e.stop(grace_s=2.0)
            self.engines.pop(e.name, None)

    def close(self) -> None:
        for e in list(self.engines.values()):
            e.stop()
        self.engines.clear()

    def report(self) -> str:
        return ", ".join(f"{n} {s:.1f} s{' (forked)' if f else ''}" for n, s, f in self.start_times)


@contextmanager
def running_pool(workdir: Path, label: str, forker: ForkServer | None = None) -> Iterator[EnginePool]:
    """An :class:`EnginePool` for a fixture's lifetime; prints its engine starts, then
    stops its engines."""
    pool = EnginePool(workdir, forker=forker)
    try:
        yield pool
    finally:
        print(f"\n[{label}] engine starts: {pool.report()}")
        pool.close()


# --------------------------------------------------------------------------- scenarios


def local_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's own non-disaggregated run: no kv_transfer_params, so it prefills itself."""
    reply = engine.call("generate", prompts=prompts, max_tokens=max_tokens, params=None)
    return [o["token_ids"] for o in reply["outputs"]]


def push_params(prefill: Engine, n: int, tag: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """kvbridge push mode: (prefill params, decode params) sharing one transfer id per prompt."""
    ids = [f"{tag}-{i}" for i in range(n)]
    return ([{"do_remote_decode": True, "transfer_mode": "push", "kvbridge_transfer_id": t} for t in ids],
            [{"do_remote_prefill": True, "transfer_mode": "push", "kvbridge_transfer_id": t,
              "remote_host": HOST, "remote_port": prefill.port} for t in ids])


def pd_round(prefill: Engine, decode: Engine, prompts: list[list[int]], max_tokens: int, *,
             push: bool = False, kill_prefill_before_pull: bool = False,
             freeze_prefill_s: float = 0.0,
             deadline_s: float = COMMAND_DEADLINE_S, flush: bool = True) -> DisaggRun:
    """One disaggregated batch on running engines; metrics and logs cover this batch only.

    Pull: prefill generates 1 token per prompt with ``{"do_remote_decode": True}``; the
    decode engine then generates ``max_tokens`` with the ``kv_transfer_params`` prefill
    returned. Prefill stays alive (idle) meanwhile. With ``kill_prefill_before_pull`` the
    prefill engine is killed (SIGKILL) between the two; with ``freeze_prefill_s`` it is
    stopped (SIGSTOP) then, and continued that many seconds later. Push: both engines get the batch
    at once with shared transfer ids (kvbridge's push protocol). With ``flush`` the
    prefill engine then runs one local request after a second, so that the release
    notifications and its connector stats reach its metrics.
    """
    connector = decode.d.connector
    if connector is None or prefill.d.connector != connector:
        raise ValueError("pd_round needs a prefill and a decode engine with the same connector")
    p_off, d_off = prefill.log_offset(), decode.log_offset()
    p_start, d_start = prefill.metrics(), decode.metrics()
    tag = f"{prefill.name}-{decode.name}-{time.monotonic_ns()}"
    prefill_exit: int | None = 0
    if push:
        p_params, d_params = push_params(prefill, len(prompts), tag)
        d_seq = decode.send("generate", prompts=prompts, max_tokens=max_tokens, params=d_params)
        p_seq = prefill.send("generate", prompts=prompts, max_tokens=1, params=p_params)
        p_rec = prefill.wait(p_seq, deadline_s, others=[decode])
        # An in-process engine steps only inside a command; kvbridge's prefill side finishes
        # a push (release, notification) in later steps, which the old one-process-per-core
        # engine loop ran by itself. Keep the prefill engine stepping until decode is done.
        end = time.monotonic() + deadline_s
        while not (decode.ctrl / f"reply_{d_seq}.json").exists() and time.monotonic() < end:
            if not decode.alive():
                break
            prefill.call("flush", 300, prompt=prompts[0][:8], delay_s=0.2)
        d_rec = decode.wait(d_seq, deadline_s, others=[prefill])
    else:
        p_rec = prefill.call("generate", deadline_s, prompts=prompts, max_tokens=1,
                             params=[{"do_remote_decode": True} for _ in prompts])
        params = [o["kv_transfer_params"] for o in p_rec["outputs"]]
        if len(params) != len(prompts) or not all(params):
            raise EngineFailed(f"{prefill.name} returned kv_transfer_params {params!r}")
        if kill_prefill_before_pull:
            prefill.kill()
            prefill_exit = prefill.exit_code()
        thaw = prefill.freeze(freeze_prefill_s) if freeze_prefill_s > 0 else None
        try:
            d_seq = decode.send("generate", prompts=prompts, max_tokens=max_tokens, params=params)
            d_rec = decode.wait(d_seq, deadline_s, others=[] if kill_prefill_before_pull else [prefill])
        finally:
            if thaw is not None:
                thaw.join()
    p_end = p_rec["metrics"]
    if flush and prefill.alive():
        p_end = prefill.call("flush", 300, prompt=prompts[0][:8], delay_s=1.0)["metrics"]
    run = DisaggRun(
        connector,
        {"rounds": [p_rec], "metrics_start": p_start, "metrics_end": p_end,
         "engine_start_s": prefill.ready.get("engine_start_s")},
        {"rounds": [d_rec], "metrics_start": d_start, "metrics_end": d_rec["metrics"],
         "engine_start_s": decode.ready.get("engine_start_s")},
        prefill.log_since(p_off), decode.log_since(d_off), prefill_exit)
    return run


def tokens_of(rec: Mapping[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in rec["outputs"]]


def baseline(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """:func:`local_tokens`, checked: full length, and different prompts give different
    continuations (the model is not degenerate, so a wrong KV shows)."""
    tokens = local_tokens(engine, prompts, max_tokens)
    if len(tokens) != len(prompts) or any(len(t) != max_tokens for t in tokens):
        raise AssertionError(f"{engine.name}: local run gave {[len(t) for t in tokens]} tokens, "
                             f"expected {max_tokens} for each of {len(prompts)} prompts")
    if len({tuple(t) for t in tokens}) != len(tokens):
        raise AssertionError(f"{engine.name}: prompts gave equal continuations {tokens}")
    return tokens
