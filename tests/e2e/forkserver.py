"""Fork the e2e engines from a server that imported vLLM once.

Importing vLLM (and with it torch's compiler stack) takes about 30 s of CPU on
these machines; building a tiny engine in-process takes about 5 s. The e2e suite
starts some thirty engines, so the imports were most of its time. The harness
therefore starts engines through the standard library's fork server
(``multiprocessing.get_context("forkserver")``) with vLLM and ``engine_runner``
preloaded: the server imports them once, and every engine is a fork of it (as
``kvbridge.tools.process_start`` does for the soak's harness processes). The child
becomes its own session leader (the harness stops it and its TP workers as a
process group), takes the harness's pipe as stdin and the engine log as stdout
and stderr, switches to the engine's environment and working directory, and
runs ``engine_runner.main``.

Only engines that would read the same import-time settings may be forked (the
harness decides, see :func:`forkable`): an in-process engine core with one
OpenMP thread per worker (``OMP_NUM_THREADS=1`` is read when torch loads its
OpenMP runtime, i.e. in the server). TP workers are still spawned by vLLM as
fresh interpreters. The server is the harness process's one multiprocessing fork
server: nothing else in the e2e session may use that start method.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: what the server's environment fixes for every child (see the module doc)
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "TORCHINDUCTOR_VEC_ISA_OK": "1", "PYTHONUNBUFFERED": "1"}
#: settings vLLM or torch read at import time: a child must not need other values
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING",
                   "VLLM_LOGGING_CONFIG_PATH", "TORCHINDUCTOR_VEC_ISA_OK", "LD_PRELOAD")
#: what the server imports before it forks anything
PRELOAD = ["engine_runner", "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.inputs"]


def forkable(env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether an engine with ``env`` may be forked from a server started with ``base``."""
    return env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and all(
        env.get(k) == base.get(k) for k in IMPORT_TIME_ENV)


# --------------------------------------------------------------------------- harness side


class ForkedProcess:
    """The part of ``subprocess.Popen`` the harness uses, for a forked engine."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, stdin_fd: int) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.stdin = os.fdopen(stdin_fd, "wb")

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout or 0.0)
        return self._proc.exitcode


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (the fork server starts with this process's)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class ForkServer:
    """The session's fork server; :meth:`spawn` forks an engine from it."""

    def __init__(self, workdir: Path, env: Mapping[str, str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**env, **SERVER_ENV}
        # Python 3.11's fork server does not take the harness's sys.path before it preloads
        # (its children do): engine_runner is found through PYTHONPATH
        self._server_env = {**self.env, "PYTHONPATH": os.pathsep.join(
            p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)}
        self.log_path = workdir / "forkserver.log"
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._children: list[ForkedProcess] = []
        self._closed = False

    def wait_ready(self, deadline_s: float = 600.0) -> None:
        """Start the server (its imports) and fork one empty child to see it answer."""
        t0 = time.perf_counter()
        with _environ(self._server_env):
            multiprocessing.forkserver.ensure_running()
        probe = self._ctx.Process(target=_probe, name="forkserver-probe")
        probe.start()
        probe.join(deadline_s)
        if probe.exitcode != 0:
            probe.kill()
            raise RuntimeError("the fork server could not import " + ", ".join(PRELOAD)
                               if probe.exitcode == 3 else
                               f"the fork server forked no child within {deadline_s:.0f} s "
                               f"(exit {probe.exitcode})")
        self.log_path.write_text(f"fork server ready in {time.perf_counter() - t0:.1f} s "
                                 f"(imports: {', '.join(PRELOAD)})\n")

    def alive(self) -> bool:
        return not self._closed

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
        r, w = os.pipe()
        stdin = multiprocessing.connection.Connection(r, writable=False)  # pickled as a passed fd
        proc = self._ctx.Process(target=_engine, name=f"engine-{Path(cwd).name}",
                                 args=(list(argv), dict(env), str(cwd), str(log_path), stdin))
        try:
            proc.start()
        except BaseException:
            os.close(w)
            raise
        finally:
            stdin.close()
        child = ForkedProcess(proc, w)
        self._children.append(child)
        with open(self.log_path, "a") as log:
            log.write(f"forked {proc.pid}: {' '.join(argv[-2:])}\n")
        return child

    def close(self) -> None:
        """Kill what is left of the engines (the pools stop theirs first); the server
        itself ends with this process."""
        self._closed = True
        for c in self._children:
            if c.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.pid, signal.SIGKILL)
                c.wait(10)


# --------------------------------------------------------------------------- child side


def _probe() -> None:
    """An empty child: the server answers; exit 3 when a preload failed (the server
    skips modules it cannot import)."""
    if any(m not in sys.modules for m in PRELOAD):
        sys.exit(3)


def _engine(argv: list[str], env: dict[str, str], cwd: str, log_path: str,
            stdin: multiprocessing.connection.Connection) -> None:
    """In the forked child: run ``engine_runner`` as its own script would."""
    os.setsid()
    os.dup2(stdin.fileno(), 0)
    stdin.close()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the child's stdin
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv[1:]  # as the script would see it (no interpreter)
    import engine_runner

    code = int(engine_runner.main(sys.argv) or 0)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
