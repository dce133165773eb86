"""Served P/D for the e2e tests: vLLM OpenAI servers and ``kvbridge router`` as processes.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` with
``--kv-transfer-config`` for kvbridge's connector; the router is the real
``kvbridge router`` command of the e2e environment. Imports neither vLLM nor
torch (it talks HTTP), so bench scripts may use it too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from e2e_harness import (
    KVBRIDGE_CONNECTOR,
    MODEL_SCRIPT,
    REPO_ROOT,
    ConnectorUnderTest,
    e2e_python,
    free_port,
    kvbridge_push,
    missing_env_reason,
    stop_process_group,
)

HOST = "127.0.0.1"
MODEL_NAME = "tiny"
#: Decode instances recompute locally when a pull fails (a prefill instance died between
#: its answer and the pull): the request is slower, never lost. See docs/serving.md.
SERVED_CONNECTOR: ConnectorUnderTest = replace(KVBRIDGE_CONNECTOR, kv_load_failure_policy="recompute")
#: The same in push mode, each layer written as vLLM computes it (``push_layerwise``).
SERVED_PUSH_CONNECTOR: ConnectorUnderTest = replace(kvbridge_push(), kv_load_failure_policy="recompute")


def served_model(kv_heads: int = 2, *, layers: int = 2, vocab: int = 1024, seed: int = 0,
                 cache_dir: Path | None = None) -> Path:
    """A tiny random Llama with a local word-level tokenizer (built once, cached)."""
    cache_dir = cache_dir or REPO_ROOT / ".e2e" / "models"
    out = cache_dir / f"tiny-llama-l{layers}-kv{kv_heads}-s{seed}-v{vocab}-wordtok"
    if (out / "tokenizer.json").exists() and (out / "model.safetensors").exists():
        return out
    py = e2e_python()
    if py is None:
        raise RuntimeError(missing_env_reason() or "no e2e python")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([py, str(MODEL_SCRIPT), str(tmp), "--kv-heads", str(kv_heads), "--layers",
                    str(layers), "--vocab", str(vocab), "--seed", str(seed), "--word-tokenizer"],
                   check=True, timeout=600, capture_output=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def text_prompts(lengths: Sequence[int], *, vocab: int = 1024, seed: int = 0) -> list[str]:
    """Deterministic prompts of ``w<id>`` words (one token each with the word tokenizer)."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(4, vocab)}" for _ in range(n)) for n in lengths]


# --------------------------------------------------------------------------- HTTP


def http_json(url: str, body: Mapping[str, Any] | None = None, timeout: float = 300) -> Any:
    """GET (no body) or POST JSON; returns the decoded answer, raises on non-2xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with _opener.open(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_text(url: str, timeout: float = 60) -> str:
    with _opener.open(url, timeout=timeout) as resp:
        return resp.read().decode()


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an env proxy


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


# --------------------------------------------------------------------------- processes


@dataclass
class Served:
    """One server process (an engine or the router) in its own session."""

    name: str
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Served:
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, cwd=self.log_path.parent,
                                     start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with _opener.open(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http_text(self.url + "/metrics"))

    def kill(self, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, sig, grace_s)


def stop_all(servers: Sequence[Served], grace_s: float = 15.0) -> None:
    """SIGTERM every server at once, then wait (SIGKILL after ``grace_s``)."""
    for s in servers:
        if s.alive() and s.proc is not None:
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace_s
    while any(s.alive() for s in servers) and time.monotonic() < end:
        time.sleep(0.2)
    for s in servers:
        s.kill(grace_s=0.0)


def wait_ready(servers: Sequence[Served], deadline_s: float) -> None:
    """Wait until every server answers /health; raise with log tails when one dies or the
    deadline passes."""
    end = time.monotonic() + deadline_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"{s.name} exited with {s.proc.poll() if s.proc else None}\n"
                                   + "\n".join(f"----- {x.name} -----\n{x.log_tail()}" for x in servers))
            if s.healthy():
                s.ready_s = time.monotonic() - s.started_at
                pending.remove(s)
        if pending and time.monotonic() > end:
            raise RuntimeError(f"not ready within {deadline_s:.0f} s: {[s.name for s in pending]}\n"
                               + "\n".join(f"----- {x.name} -----\n{x.log_tail()}" for x in pending))
        time.sleep(0.5)


def engine(name: str, model: Path, role: str, workdir: Path, *, tp: int = 1, cpus: str = "nobind",
           connector: ConnectorUnderTest = SERVED_CONNECTOR, max_model_len: int = 512,
           kv_cache_bytes: int = 64 << 20, prefix_caching: bool = False) -> Served:
    """A vLLM OpenAI server for ``role`` ("prefill" or "decode") with kvbridge's connector
    (prefix caching off unless ``prefix_caching``).

    Its engine core and TP workers are spawned, each importing vLLM again (about
    30 s of CPU here): vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD to
    spawn whatever the environment says."""
    py = e2e_python()
    if py is None:
        raise RuntimeError(missing_env_reason() or "no e2e python")
    port, side_port = free_port(), free_port()
    kv_cfg = connector.kv_transfer_config(role, HOST, side_port)
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(port),
            "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--enforce-eager", "--max-model-len", str(max_model_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--seed", "0", "--max-num-seqs", "16", "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(kv_cfg)]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    env = {"PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1",
           "VLLM_CPU_OMP_THREADS_BIND": cpus, **connector.engine_env(HOST, side_port)}
    if cpus == "nobind":
        env["OMP_NUM_THREADS"] = "1"
    workdir.mkdir(parents=True, exist_ok=True)
    return Served(name, port, argv, env, workdir / f"{name}.log", extra={"role": role, "tp": tp})


def router(prefill: Sequence[Served], decode: Sequence[Served], workdir: Path, *,
           name: str = "router", extra_args: Sequence[str] = ()) -> Served:
    """The ``kvbridge router`` command of the e2e environment in front of the engines
    (``extra_args`` come last, so they override the defaults here)."""
    py = e2e_python()
    if py is None:
        raise RuntimeError(missing_env_reason() or "no e2e python")
    kvbridge = Path(py).with_name("kvbridge")
    cmd = [str(kvbridge), "router"] if kvbridge.exists() else [py, "-m", "kvbridge.router"]
    port = free_port()
    # bounds fit two shared cores: a TP 2 engine's first forward pass took up to 50 s here
    argv = cmd + ["--prefill", *[p.url for p in prefill], "--decode", *[d.url for d in decode],
                  "--host", HOST, "--port", str(port), "--prefill-timeout", "180",
                  "--decode-timeout", "300", "--health-interval", "1", "--health-timeout", "30",
                  "--log-level", "debug", *extra_args]
    workdir.mkdir(parents=True, exist_ok=True)
    return Served(name, port, argv, {"PYTHONUNBUFFERED": "1"}, workdir / f"{name}.log")


def push_router_args(prefill: Sequence[Served]) -> list[str]:
    """``kvbridge router`` flags for push mode: each prefill engine's side channel, as
    :func:`engine` configured it."""
    return ["--mode", "push", "--prefill-side-channel",
            *[f"{p.url}={HOST}:{p.env['KVBRIDGE_SIDE_CHANNEL_PORT']}" for p in prefill]]


def completion_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """Greedy, fixed-length completion (ignore_eos: every run makes ``max_tokens`` tokens)."""
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
