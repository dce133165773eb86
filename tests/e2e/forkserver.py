"""A fork server for the e2e engines: import vLLM once, fork one child per engine.

Importing vLLM (and with it torch's compiler stack) takes about 30 s of CPU on
these machines; building a tiny engine in-process takes about 5 s. The e2e suite
starts some thirty engines, so the imports were most of its time. The harness
therefore starts this script once per session (``python forkserver.py --serve
SOCKET``, in the e2e environment): it imports vLLM and ``engine_runner``, then
forks a child for every engine the harness asks for. The child becomes its own
session leader (the harness stops it and its TP workers as a process group), takes
the harness's pipe as stdin and the engine log as stdout and stderr, switches to
the engine's environment and working directory, and runs ``engine_runner.main``.

Only engines that would read the same import-time settings may be forked (the
harness decides, see :func:`forkable`): an in-process engine core with one
OpenMP thread per worker (``OMP_NUM_THREADS=1`` is read when torch loads its
OpenMP runtime, i.e. in this server). TP workers are still spawned by vLLM as
fresh interpreters.

Protocol on the Unix socket, one connection per child: the harness sends one
JSON line ``{"argv", "env", "cwd"}`` with two file descriptors attached (the
child's stdin and its log); the server answers ``{"pid": N}`` and, when the child
has exited, ``{"exit": code}`` (negative: killed by that signal). The server is
single-threaded (it forks), reaps its children itself, and exits when the harness
closes its stdin. :class:`ForkServer` and :class:`ForkedProcess` are the harness
side (no vLLM import).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: what the server's environment fixes for every child (see the module doc)
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "TORCHINDUCTOR_VEC_ISA_OK": "1", "PYTHONUNBUFFERED": "1"}
#: settings vLLM or torch read at import time: a child must not need other values
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING",
                   "VLLM_LOGGING_CONFIG_PATH", "TORCHINDUCTOR_VEC_ISA_OK", "LD_PRELOAD")


def forkable(env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether an engine with ``env`` may be forked from a server started with ``base``."""
    return env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and all(
        env.get(k) == base.get(k) for k in IMPORT_TIME_ENV)


# --------------------------------------------------------------------------- harness side


class ForkedProcess:
    """The part of ``subprocess.Popen`` the harness uses, for a forked engine."""

    def __init__(self, conn: socket.socket, pid: int, stdin_fd: int) -> None:
        self._conn = conn
        self._buf = b""
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = os.fdopen(stdin_fd, "wb")

    def _read_exit(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return
            chunk = self._conn.recv(4096)
            if not chunk:  # the server died: the child is gone or orphaned
                self.returncode = -signal.SIGKILL
                return
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        self.returncode = int(json.loads(line)["exit"])
        self._conn.close()

    def poll(self) -> int | None:
        self._read_exit(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout or 0.0)
        return self.returncode


class ForkServer:
    """One ``forkserver.py --serve`` process; :meth:`spawn` forks an engine from it."""

    def __init__(self, python: str, workdir: Path, env: Mapping[str, str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket_path = workdir / "forkserver.sock"
        self.socket_path.unlink(missing_ok=True)
        self.env = {**env, **SERVER_ENV}
        self.log_path = workdir / "forkserver.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--serve",
                                          str(self.socket_path)], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_ready(self, deadline_s: float = 600.0) -> None:
        end = time.monotonic() + deadline_s
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"fork server did not start (exit {self.proc.poll()}):\n{tail}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
        self.wait_ready()
        r, w = os.pipe()
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.socket_path))
            msg = json.dumps({"argv": list(argv), "env": dict(env), "cwd": str(cwd)}).encode() + b"\n"
            socket.send_fds(conn, [msg], [r, log_fd])
            buf = b""
            while b"\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError(f"fork server closed the connection; see {self.log_path}")
                buf += chunk
        except BaseException:
            conn.close()
            os.close(w)
            raise
        finally:
            os.close(r)
            os.close(log_fd)
        line, rest = buf.split(b"\n", 1)
        proc = ForkedProcess(conn, int(json.loads(line)["pid"]), w)
        proc._buf = rest
        return proc

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.socket_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- server side


def _child(conn: socket.socket, listener: socket.socket, fds: list[int], req: dict[str, Any]) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        listener.close()
        conn.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.dup2(fds[1], 2)
        os.close(fds[0])
        os.close(fds[1])
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the child's stdin
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"][1:])  # as the script would see it (no interpreter)
        import engine_runner

        code = int(engine_runner.main(sys.argv) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the engine log
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(socket_path: str) -> int:
    t0 = time.perf_counter()
    sys.path.insert(0, str(HERE))
    import engine_runner  # noqa: F401 - imported once, for every child
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    print(f"[forkserver pid={os.getpid()}] imports took {time.perf_counter() - t0:.1f} s", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = socket_path + ".tmp"
    Path(tmp).unlink(missing_ok=True)
    listener.bind(tmp)
    listener.listen(16)
    os.replace(tmp, socket_path)  # the socket appears only once it listens
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.2)
        if sys.stdin in ready and not sys.stdin.buffer.read1(4096):
            break  # the harness closed our stdin: done
        if listener in ready:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            req = json.loads(msg.split(b"\n", 1)[0])
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(conn, listener, list(fds), req)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            print(f"[forkserver] forked {pid}: {' '.join(req['argv'][-2:])}", flush=True)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    for pid in children:  # leave nothing behind
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    listener.close()
    Path(socket_path).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
