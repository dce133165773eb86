"""Run a prefill engine and a decode engine as real processes on this machine.

Each engine runs in one or more spawned processes (``ranks_per_process``
ranks each, one NIXL agent per rank) over synthetic host-memory caches; the
process holding rank 0 serves the engine's metadata on 127.0.0.1. The parent
drives requests over pipes (trusted, local) and collects per-rank results:
decode ranks verify every received byte against the expected shard.

Used by ``kvbridge demo``, ``kvbridge bench`` and the multi-process tests.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait

from kvbridge.handshake import new_incarnation
from kvbridge.nixl import EngineConfig, new_token
from kvbridge.topology import EngineSpec, TransferParams, plan_transfer

from .engine_process import child_main, per_group
from .process_start import start_context

_SEEN = {"done": ("done_at", "failed"), "failed": ("done_at", "failed"),  # where a rank's earlier
         "verified": ("done",), "released": ("released",)}  # report of a request is kept


class HarnessError(RuntimeError):
    """A harness process failed or did not answer in time."""


# ---------------------------------------------------------------------------
# parent


@dataclass
class RequestResult:
    """What every decode rank reported for one request."""

    request_id: str
    done: dict[int, int] = field(default_factory=dict)  # rank -> mismatching bytes (-1: unchecked)
    done_at: dict[int, float] = field(default_factory=dict)  # rank -> time.monotonic() of completion
    loaded_at: dict[int, float] = field(default_factory=dict)  # rank -> time.monotonic() of load()
    load_call_us: dict[int, float] = field(default_factory=dict)  # rank -> duration of load() (posting)
    failed: dict[int, tuple[str, tuple[int, ...], str]] = field(default_factory=dict)
    released: dict[int, str] = field(default_factory=dict)  # prefill rank -> reason

    @property
    def ok(self) -> bool:
        return not self.failed and all(v <= 0 for v in self.done.values())  # -1: not verified

    @property
    def mismatches(self) -> int:
        return sum(v for v in self.done.values() if v > 0)


class EngineGroup:
    """The processes of one engine."""

    def __init__(self, role: str, spec: EngineSpec, num_blocks: int, config: EngineConfig,
                 ranks_per_process: int | None = None, incarnation: str | None = None, ctx=None):
        self.role, self.spec, self.num_blocks, self.config = role, spec, num_blocks, config
        self.ctx = ctx or start_context()
        self.incarnation = incarnation or new_incarnation()
        per = ranks_per_process or spec.tp_size
        self.groups = [list(range(i, min(i + per, spec.tp_size))) for i in range(0, spec.tp_size, per)]
        self.procs: list = []
        self.conns: list[Connection] = []
        self.host: str = ""
        self.port: int = 0
        self.alive = False

    def start(self, timeout: float = 300.0) -> None:
        self.launch()
        self.await_ready(timeout)

    def launch(self) -> None:
        for i, ranks in enumerate(self.groups):
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=child_main, args=(child, self.role, self.spec, ranks, self.num_blocks,
                                                  self.config, self.incarnation, i == 0), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def await_ready(self, timeout: float = 300.0) -> None:
        extra = []
        for i, c in enumerate(self.conns):
            msg = _recv(c, timeout, f"{self.role} process {i} start")
            if msg[0] != "ready":
                raise HarnessError(f"{self.role} process {i} failed to start: {msg}")
            if i == 0:
                self.host, self.port = msg[1], msg[2]
            else:
                extra.extend(msg[3].values())
        if extra:
            self.conns[0].send(("publish", extra))
            _expect_ok(self.conns[0], timeout, lambda msg: None)
            for c in self.conns[1:]:
                c.send(("advertise", (self.host, self.port)))
                _expect_ok(c, timeout, lambda msg: None)
        self.alive = True

    def broadcast(self, cmd: str, arg, sink, timeout: float = 60.0) -> None:
        """Send a command to every process; events that arrive before the replies go to ``sink``."""
        for c in self.conns:
            c.send((cmd, arg))
        for c in self.conns:
            _expect_ok(c, timeout, sink)

    @property
    def pids(self) -> list[int]:  # process i runs ranks groups[i]
        return [p.pid for p in self.procs]

    def signal(self, index: int, sig: int) -> None:  # fault injection: SIGKILL, SIGSTOP, SIGCONT
        os.kill(self.procs[index].pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        self.alive = False

    def close(self, timeout: float = 30.0) -> None:
        if not self.alive:
            self.kill()
            return
        for c in self.conns:
            try:
                c.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout)
        self.kill()


def _recv(c: Connection, timeout: float, what: str):
    if not c.poll(timeout):
        raise HarnessError(f"{what}: no answer within {timeout:.0f} s")
    msg = c.recv()
    if msg[0] == "crash":
        raise HarnessError(f"{what}: child crashed:\n{msg[1]}")
    return msg


class Cluster:
    """A prefill engine and a decode engine in real processes, driven from this process."""

    def __init__(self, prefill: EngineSpec, decode: EngineSpec, *, num_blocks: int = 64,
                 config: EngineConfig | None = None, decode_config: EngineConfig | None = None,
                 ranks_per_process: int | None = None, start_method: str = "spawn"):
        self.plan = plan_transfer(prefill, decode)
        self.ctx = start_context(start_method)
        self.config = config or EngineConfig()
        self.decode_config = decode_config or self.config
        self.num_blocks = num_blocks
        self.ranks_per_process = ranks_per_process
        self.prefill = self._group("p", prefill, self.config)
        self.decode = self._group("d", decode, self.decode_config)
        self.results: dict[str, RequestResult] = {}
        self.events: list[tuple] = []
        self.duplicates: list[tuple] = []  # a rank reporting one request twice (must stay empty)
        self._tokens: dict[str, str] = {}

    @property
    def mode(self) -> str:
        return self.config.mode

    def start(self) -> Cluster:
        self.prefill.launch()
        self.decode.launch()
        self.prefill.await_ready()
        self.decode.await_ready()
        return self

    def restart_prefill(self) -> None:
        """Kill the prefill engine and start a new incarnation on a new port."""
        self.prefill.kill()
        self.prefill = self._group("p", self.prefill.spec, self.config)
        self.prefill.start()

    def restart_decode(self) -> None:
        """Kill the decode engine and start a new incarnation on a new port."""
        self.decode.kill()
        self.decode = self._group("d", self.decode.spec, self.decode_config)
        self.decode.start()

    def _group(self, role: str, spec: EngineSpec, config: EngineConfig) -> EngineGroup:
        return EngineGroup(role, spec, self.num_blocks, config, self.ranks_per_process, ctx=self.ctx)

    def params(self, rid: str, p_blocks: list[int], token: str) -> TransferParams:
        p = self.prefill
        return TransferParams(p.spec.engine_id, p.host, p.port, p.spec.tp_size, per_group(p.spec, p_blocks), token,
                              p.incarnation)

    def fill(self, seed: int, p_blocks: list[int], num_tokens: int | None = None) -> int:
        """Write a request's synthetic KV content into prefill blocks; returns its token count."""
        ntok = num_tokens if num_tokens is not None else len(p_blocks) * self.prefill.spec.block_size
        self.prefill.broadcast("fill", (seed, ntok, list(p_blocks)), self._absorb)
        return ntok

    def submit(self, rid: str, seed: int, p_blocks: list[int], d_blocks: list[int], *,
               num_tokens: int | None = None, computed_tokens: int = 0, token: str | None = None,
               load: bool = True, fill: bool = True, verify: bool = True) -> TransferParams:
        """Fill and hold the prefill blocks, then make the decode engine load (or await) them."""
        ntok = num_tokens if num_tokens is not None else len(p_blocks) * self.prefill.spec.block_size
        if fill:
            self.fill(seed, p_blocks, ntok)
        token = token or new_token()
        self._tokens[rid] = token
        self.results[rid] = RequestResult(rid)
        params = self.params(rid, p_blocks, token)
        dspec = self.decode.spec
        if self.mode == "pull":
            self.prefill.broadcast("hold", (rid, list(p_blocks), token), self._absorb)
            if load:
                self.load(rid, params, d_blocks, seed, ntok, computed_tokens, verify)
        else:
            self.decode.broadcast("expect", (rid, params, list(d_blocks), computed_tokens, seed, ntok,
                                             self.prefill.spec, verify), self._absorb)
            target = TransferParams(dspec.engine_id, self.decode.host, self.decode.port, dspec.tp_size,
                                    per_group(dspec, d_blocks), token, computed_tokens=computed_tokens)
            self.prefill.broadcast("push", (rid, list(p_blocks), target), self._absorb)
        return params

    def clear_decode(self, d_blocks: list[int]) -> None:
        """Zero decode blocks on every decode rank now (see ``cleared`` of :meth:`submit_batch`)."""
        self.decode.broadcast("clear", list(d_blocks), self._absorb)

    def submit_batch(self, batch: list[tuple[str, int, list[int], list[int], int]], *,
                     verify: bool = True, cleared: bool = False) -> None:
        """Hand a batch of requests ``(rid, seed, p_blocks, d_blocks, num_tokens)`` (prefill
        blocks already filled) to both engines the way an engine's scheduler step does: each
        process gets the whole batch in one message, every process's message is sent before any
        answer is awaited, and each rank starts every request of the batch before polling for
        completions, so the requests are in flight together (see :meth:`peaks`).

        With ``verify`` the decode blocks are zeroed before the load, so that bytes a transfer
        failed to write show; ``cleared=True`` says the caller zeroed them already
        (:meth:`clear_decode`), keeping that harness work out of the batch's time."""
        holds, loads, pushes = [], [], []
        dspec = self.decode.spec
        for rid, seed, pb, db, ntok in batch:
            token = new_token()
            self._tokens[rid] = token
            self.results[rid] = RequestResult(rid)
            params = self.params(rid, pb, token)
            holds.append((rid, list(pb), token))
            loads.append((rid, params, list(db), 0, seed, ntok, self.prefill.spec, verify,
                          verify and not cleared))
            pushes.append((rid, list(pb), TransferParams(dspec.engine_id, self.decode.host, self.decode.port,
                                                         dspec.tp_size, per_group(dspec, db), token)))
        if self.mode == "pull":
            self.prefill.broadcast("batch", ("hold", holds), self._absorb)
            self.decode.broadcast("batch", ("load", loads), self._absorb)
        else:
            self.decode.broadcast("batch", ("expect", loads), self._absorb)
            self.prefill.broadcast("batch", ("push", pushes), self._absorb)

    def load(self, rid: str, params: TransferParams, d_blocks: list[int], seed: int, ntok: int,
             computed_tokens: int = 0, verify: bool = True) -> None:
        self.results.setdefault(rid, RequestResult(rid))
        self.decode.broadcast("load", (rid, params, list(d_blocks), computed_tokens, seed, ntok,
                                       self.prefill.spec, verify), self._absorb)

    def _pump(self, timeout: float) -> bool:
        conns = {}
        for grp in (self.prefill, self.decode):
            if grp.alive:
                for c in grp.conns:
                    conns[c] = grp
        ready = wait(list(conns), timeout)
        for c in ready:
            try:
                kind, arg = c.recv()
            except (EOFError, OSError):
                conns[c].alive = False
                continue
            if kind == "crash":
                raise HarnessError(f"a {conns[c].role} process crashed:\n{arg}")
            self._absorb((kind, arg))
        return bool(ready)

    def ended(self, rid: str) -> bool:
        """Every decode rank reported the request done or failed (bytes may be unverified yet)."""
        res = self.results.get(rid)
        return res is not None and len(res.done_at) + len(res.failed) >= self.decode.spec.tp_size

    def finished(self, rid: str) -> bool:
        res = self.results.get(rid)
        return res is not None and len(res.done) + len(res.failed) >= self.decode.spec.tp_size

    def released(self, rid: str) -> bool:
        res = self.results.get(rid)
        return res is not None and len(res.released) >= self.prefill.spec.tp_size

    def wait(self, rids: list[str], timeout: float = 60.0, *, released: bool = False,
             on_progress=None) -> dict[str, RequestResult]:
        """Pump events until every request in ``rids`` finished on every decode rank (and, with
        ``released=True``, was released on every prefill rank); raises HarnessError on timeout."""
        deadline = time.monotonic() + timeout
        left = set(rids)
        asked = False
        while left:
            if not asked and all(self.ended(r) for r in left):
                for c in self.decode.conns:
                    try:
                        c.send(("verify", None))
                    except (BrokenPipeError, OSError):
                        pass
                asked = True
            done_now = {r for r in left if self.finished(r) and (not released or self.released(r))}
            if done_now and on_progress is not None:
                on_progress(len(done_now))
            left -= done_now
            if not left:
                break
            if time.monotonic() > deadline:
                raise HarnessError(f"requests {sorted(left)[:5]} not finished within {timeout:.0f} s")
            self._pump(min(0.5, max(0.0, deadline - time.monotonic())))
        return {r: self.results[r] for r in rids}

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._pump(deadline - time.monotonic())

    def rank_stats(self, group: EngineGroup) -> dict[int, tuple]:
        """rank -> (Stats, resource counts) of every rank of ``group``."""
        return self._ask(group, "stats")

    def peaks(self, group: EngineGroup) -> dict[int, tuple[int, int]]:
        """rank -> (most requests outstanding at once, most live NIXL transfer handles at once)
        since the group started: requests loading or awaited on a decode rank, held on a prefill
        rank (sampled once per round of the process's loop); handles as the agent counted them
        (:meth:`~kvbridge.nixl.agent.NixlAgent.take_transfers_peak`, the engine's warm-up
        left out)."""
        return self._ask(group, "peaks")

    def _ask(self, group: EngineGroup, cmd: str) -> dict[int, tuple]:
        out: dict[int, tuple] = {}
        for c in group.conns:
            c.send((cmd, None))
        for c in group.conns:
            while True:
                msg = _recv(c, 30, cmd)
                if msg[0] == cmd:
                    out.update(msg[1])
                    break
                self._absorb(msg)
        return out

    def _absorb(self, msg) -> None:
        kind, arg = msg
        self.events.append(msg)
        if kind == "crash":
            raise HarnessError(f"a harness process crashed:\n{arg}")
        res = self.results.get(arg[1]) if kind in ("done", "verified", "failed", "released") else None
        if res is not None and any(arg[0] in getattr(res, a) for a in _SEEN[kind]):
            self.duplicates.append(msg)
        if kind == "done":
            res = self.results.setdefault(arg[1], RequestResult(arg[1]))
            res.done_at[arg[0]], res.loaded_at[arg[0]], res.load_call_us[arg[0]] = arg[2], arg[3], arg[4]
        elif kind == "verified":
            self.results.setdefault(arg[1], RequestResult(arg[1])).done[arg[0]] = arg[2]
        elif kind == "failed":
            self.results.setdefault(arg[1], RequestResult(arg[1])).failed[arg[0]] = (
                arg[2], tuple(arg[3]), arg[4])
        elif kind == "released":
            self.results.setdefault(arg[1], RequestResult(arg[1])).released[arg[0]] = arg[2]

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _expect_ok(c: Connection, timeout: float, sink) -> None:
    deadline = time.monotonic() + timeout
    while True:
        msg = _recv(c, max(0.1, deadline - time.monotonic()), "command")
        if msg[0] == "ok":
            return
        if msg[0] == "error":
            raise HarnessError(msg[1])
        sink(msg)  # an event that raced the reply


def spec_pair(prefill_tp: int = 2, decode_tp: int = 1, *, kv_heads: int = 4, head_dim: int = 64,
              layers: int = 4, dtype: str = "bf16", prefill_block_size: int = 16,
              decode_block_size: int = 16, layout: str = "kv-first", mla: bool = False,
              decode_layout: str | None = None) -> tuple[EngineSpec, EngineSpec]:
    p = EngineSpec("prefill", prefill_tp, kv_heads, head_dim, layers, prefill_block_size, dtype,
                   layout=layout, use_mla=mla)
    d = replace(p, engine_id="decode", tp_size=decode_tp, block_size=decode_block_size,
                layout=decode_layout or layout)
    return p, d
