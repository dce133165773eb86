"""Soak with faults: real prefill and decode engine processes move requests while a seeded
fault injector kills, freezes and restarts them and strangers send hostile traffic.

Run: ``uv run python tests/soak/soak.py --requests 600`` (the CI version, via ``uv run nox
-s soak``) or ``--requests 10000`` (the full run). Exits non-zero, with the reasons, when a
requirement fails; prints the table in every case. Requirements (see docs/nixl.md, "Soak"):

- every request ends exactly once, as done or failed with its blocks, within its bound;
- every byte of every request reported done equals its expected content;
- every prefill rank releases every request it held (notified, written, push failed or
  lease expired): no block leaks;
- handles, threads, fds and sockets of the surviving processes stay exactly at their value at
  the checkpoint request, and their RSS within a tolerance, with no upward trend.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass

import faults as F  # tests/soak/faults.py, beside this script
from probes import Series, flatness_problems, probe  # tests/soak/probes.py
from report import LaneReport, print_table  # tests/soak/report.py

from kvbridge.nixl import AgentConfig, EngineConfig
from kvbridge.nixl.messages import Kind
from kvbridge.tools.harness import Cluster, EngineGroup, spec_pair

CONFIG = dict(agent=AgentConfig(num_threads=1), lease_s=2.0, renew_interval_s=0.5,
              handshake_timeout_s=1.0, transfer_timeout_s=2.0)
FREEZE_S = 3.0  # longer than transfer_timeout_s
#: the longest a request may take to end, done or failed (a timeout after two handshakes)
BOUND_S = CONFIG["transfer_timeout_s"] + 2 * CONFIG["handshake_timeout_s"] + 3.0
LANES = {  # heterogeneous TP both ways, one process per rank
    "pull": dict(prefill_tp=2, decode_tp=1),
    "push": dict(prefill_tp=1, decode_tp=2),
}
WAVE = 8  # requests posted together
NUM_BLOCKS = 48
RSS_TOL_KIB = 4096
#: faults after which a probe waits for the survivors' connections to settle (probe_all)
DEPARTING = {F.KILL_PREFILL_RANK, F.RESTART_PREFILL, F.KILL_DECODE_RANK}
SETTLE_S = 3.0
#: how long a probe waits for given-up transfers to end (a frozen peer runs again by then)
KEPT_S = 10.0
RELEASE_REASONS = {"notified", "lease-expired", "written", "push-failed"}
#: sockets a process keeps per peer agent that died: one per UCX worker thread (probes.py)
LEFT_PER_PEER = CONFIG["agent"].num_threads


class SoakFailure(AssertionError):
    pass


@dataclass
class Req:
    rid: str
    seed: int
    p_blocks: list[int]
    d_blocks: list[int]
    ntok: int
    prefill: EngineGroup
    decode: EngineGroup
    t_submit: float
    t_end: float | None = None
    outcome: str | None = None


class Lane:
    def __init__(self, name: str, requests: int, seed: int, checkpoint: int):
        self.name, self.requests, self.checkpoint = name, requests, checkpoint
        self.rng = random.Random(seed)
        self.mode = name
        p, d = spec_pair(head_dim=16, layers=2, **LANES[name])
        self.cfg = EngineConfig(mode=self.mode, **CONFIG)
        self.cluster = Cluster(p, d, num_blocks=NUM_BLOCKS, config=self.cfg, ranks_per_process=1,
                               start_method="forkserver")
        self.report = LaneReport(name, requests, checkpoint=checkpoint)
        self.reqs: dict[str, Req] = {}
        self.frozen: tuple[EngineGroup, int, float] | None = None
        self.incarnation_no = {"p": 0, "d": 0}
        self.labels: dict[int, str] = {}
        self.held_by: Counter = Counter()  # prefill group -> requests held
        self.dead: set[int] = set()  # id() of groups that were killed
        self.departed: Counter = Counter()  # pid -> peer agents that connected to it and went away
        #: id() of the engine groups that completed a request ("done") with a peer engine that
        #: is still alive; pid -> the probes (requests finished) that found its group so
        self.connected: set[int] = set()
        self.connected_at: dict[int, set[int]] = {}
        waves = -(-requests // WAVE)
        self.waves = waves
        per = max(1, requests // 1000)
        cp_wave = max(2, checkpoint // WAVE)
        self.plan = F.schedule(seed, waves - 1, {
            F.KILL_PREFILL_RANK: per, F.FREEZE_PREFILL_RANK: per, F.RESTART_PREFILL: per,
            F.KILL_DECODE_RANK: max(1, min(2, per)), F.HOSTILE_SIDE_CHANNEL: 2 * per,
            F.FORGED_NOTIFICATIONS: 2 * per,
        }, first=1, windows={F.KILL_DECODE_RANK: (1, cp_wave - 1)})

    # ----- helpers -----------------------------------------------------------
    def fail(self, msg: str) -> None:
        raise SoakFailure(f"[{self.name}] {msg}")

    def _label(self, grp: EngineGroup) -> None:
        n = self.incarnation_no[grp.role]
        role = "prefill" if grp.role == "p" else "decode"
        for i, pid in enumerate(grp.pids):
            self.labels[pid] = f"{self.name} {role}#{n} rank {grp.groups[i][0]} (pid {pid})"

    def _restart(self, role: str) -> None:
        c = self.cluster
        old = c.prefill if role == "p" else c.decode
        self.dead.add(id(old))
        other = c.decode if role == "p" else c.prefill
        for pid in other.pids:  # every rank of one engine talks to every rank of the other here
            self.departed[pid] += old.spec.tp_size
        self.connected.discard(id(other))  # until it completes a request with the new engine
        (c.restart_prefill if role == "p" else c.restart_decode)()
        self.incarnation_no[role] += 1
        self._label(c.prefill if role == "p" else c.decode)

    def _free_blocks(self, n_blocks: int) -> list[int]:
        return self.rng.sample(range(NUM_BLOCKS), n_blocks)

    # ----- one wave ----------------------------------------------------------
    def submit_wave(self, w: int) -> list[Req]:
        c = self.cluster
        # disjoint blocks within the wave; a wave ends (all released) before the next one
        n = min(WAVE, self.requests - w * WAVE)
        sizes = [self.rng.randint(1, 3) for _ in range(n)]
        p_all = self._free_blocks(sum(sizes))
        d_all = self._free_blocks(sum(sizes))
        out, k = [], 0
        for i, nb in enumerate(sizes):
            rid = f"{self.name}-{w * WAVE + i}"
            ntok = nb * 16 - self.rng.choice([0, 0, 5, 15])
            r = Req(rid, w * WAVE + i, p_all[k:k + nb], d_all[k:k + nb], ntok, c.prefill, c.decode,
                    time.monotonic())
            k += nb
            c.submit(rid, r.seed, r.p_blocks, r.d_blocks, num_tokens=ntok)
            self.reqs[rid] = r
            self.held_by[id(c.prefill)] += 1
            out.append(r)
        return out

    def inject(self, kind: str, wave: list[Req]) -> dict | None:
        c, rng = self.cluster, self.rng
        self.report.faults[kind] += 1
        if kind == F.KILL_PREFILL_RANK:
            c.prefill.signal(rng.randrange(len(c.prefill.procs)), signal.SIGKILL)
            self._restart("p")
        elif kind == F.RESTART_PREFILL:
            self._restart("p")
        elif kind == F.FREEZE_PREFILL_RANK:
            i = rng.randrange(len(c.prefill.procs))
            c.prefill.signal(i, signal.SIGSTOP)
            self.frozen = (c.prefill, i, time.monotonic() + FREEZE_S)
        elif kind == F.KILL_DECODE_RANK:
            c.decode.signal(rng.randrange(len(c.decode.procs)), signal.SIGKILL)
            now = time.monotonic()
            for r in wave:  # the engine died under them: nobody can report them any more
                if r.outcome is None and not c.ended(r.rid):
                    r.outcome, r.t_end = "failed:decode-killed", now
            self._restart("d")
        elif kind == F.HOSTILE_SIDE_CHANNEL:
            targets = [c.prefill] + ([c.decode] if self.mode == "push" else [])
            for grp in targets:
                F.garbage_side_channel(grp.host, grp.port, rng)
            return {"check_serving": targets}
        elif kind == F.FORGED_NOTIFICATIONS:
            grp = c.prefill if self.mode == "pull" else c.decode
            sender_tp = c.decode.spec.tp_size if self.mode == "pull" else c.prefill.spec.tp_size
            before = self._notif_counts(grp)
            kind_ = Kind.DONE if self.mode == "pull" else Kind.WRITTEN

            def delivered(sent: dict[int, int]) -> bool:  # every rank refused (counted) them all
                c._pump(0.005)  # the wave's ends meanwhile count when they came, not after this
                self._stamp_ends(wave)
                after = self._notif_counts(grp)
                return all(after[r] - before[r] >= n for r, n in sent.items())

            sent = F.forge_notifications(grp.host, grp.port, list(range(grp.spec.tp_size)),
                                         grp.spec.engine_id, _compat(grp), [r.rid for r in wave],
                                         rng, kind_, sender_tp, delivered)
            return {"forged": (grp, before, sent)}  # a stranger leaves no socket behind
        return None

    def _notif_counts(self, grp: EngineGroup) -> dict[int, int]:
        out = {}
        for rank, (s, _) in self.cluster.rank_stats(grp).items():
            out[rank] = (s.notifications_bad_token + s.notifications_unknown + s.notifications_malformed
                         + s.notifications_duplicate + s.notifications_unassigned)
        return out

    def _stamp_ends(self, wave: list[Req]) -> None:
        now = time.monotonic()
        for r in wave:
            if r.t_end is None and self.cluster.ended(r.rid):
                r.t_end = now

    def wait_wave(self, wave: list[Req]) -> None:
        c = self.cluster
        limit = BOUND_S + self.cfg.lease_s + FREEZE_S + 20.0
        deadline = time.monotonic() + limit
        asked = False
        while True:
            now = time.monotonic()
            if self.frozen and now >= self.frozen[2]:
                grp, i, _ = self.frozen
                if id(grp) not in self.dead:
                    grp.signal(i, signal.SIGCONT)
                self.frozen = None
            self._stamp_ends(wave)
            ended = all(r.t_end is not None for r in wave)
            if ended and not asked:
                for conn in c.decode.conns:
                    try:
                        conn.send(("verify", None))
                    except (BrokenPipeError, OSError):
                        pass
                asked = True
            if ended and not self.frozen and all(self._settled(r) for r in wave):
                return
            if now > deadline:
                left = [r.rid for r in wave if r.t_end is None or not self._settled(r)]
                self.fail(f"requests {left} did not end (or were not released) within {limit:.0f} s: "
                          f"{[c.results.get(x) for x in left[:2]]}")
            c._pump(0.02)

    def _settled(self, r: Req) -> bool:
        res = self.cluster.results[r.rid]
        if (r.outcome is None and id(r.decode) not in self.dead
                and any(rank not in res.done for rank in res.done_at)):
            return False  # bytes not verified yet
        if id(r.prefill) in self.dead:
            return True  # its blocks went with the process
        return len(res.released) >= r.prefill.spec.tp_size

    def judge(self, wave: list[Req]) -> None:
        c, rep = self.cluster, self.report
        dtp = c.decode.spec.tp_size
        per_token = c.decode.spec.bytes_per_token  # on one decode rank
        for r in wave:
            res = c.results[r.rid]
            rep.max_end_s = max(rep.max_end_s, r.t_end - r.t_submit)
            if r.t_end - r.t_submit > BOUND_S:
                self.fail(f"{r.rid} ended after {r.t_end - r.t_submit:.1f} s > {BOUND_S:.1f} s")
            if r.outcome is None:
                if res.failed:
                    for rank, (kind, invalid, msg) in res.failed.items():
                        if sorted(invalid) != sorted(r.d_blocks):
                            self.fail(f"{r.rid} failed on rank {rank} ({kind}: {msg}) naming blocks "
                                      f"{invalid}, not its blocks {r.d_blocks}")
                    r.outcome = "failed:" + sorted(k for k, _, _ in res.failed.values())[0]
                elif id(r.decode) in self.dead and set(res.done) != set(range(dtp)):
                    # every rank reported done, then the engine was killed before the harness
                    # compared the bytes: done, but nothing left to check
                    r.outcome = "done-unverified:decode-killed"
                else:
                    if set(res.done) != set(range(dtp)) or any(v != 0 for v in res.done.values()):
                        self.fail(f"{r.rid} done with mismatching or unverified bytes: {res.done}")
                    r.outcome = "done"
                    rep.bytes_verified += dtp * r.ntok * per_token
                    for grp, peer in ((r.prefill, r.decode), (r.decode, r.prefill)):
                        if id(peer) not in self.dead:
                            self.connected.add(id(grp))
            rep.outcomes[r.outcome] += 1
            if id(r.prefill) not in self.dead:
                if set(res.released) != set(range(r.prefill.spec.tp_size)):
                    self.fail(f"{r.rid} not released by every prefill rank: {res.released}")
                for reason in res.released.values():
                    if reason not in RELEASE_REASONS:
                        self.fail(f"{r.rid} released for an unknown reason {reason!r}")
                    rep.released[reason] += 1
                if r.outcome == "done" and self.mode == "push" and set(res.released.values()) != {"written"}:
                    self.fail(f"{r.rid} done on the decode side but released as {res.released}")

    def check_after(self, info: dict | None) -> None:
        if not info:
            return
        from kvbridge.handshake import fetch_metadata
        for grp in info.get("check_serving", []):
            if id(grp) in self.dead:
                continue
            mds = fetch_metadata(grp.host, grp.port, list(range(grp.spec.tp_size)),
                                 engine_id=grp.spec.engine_id, compat_hash=_compat(grp), timeout=2.0,
                                 retries=2)
            if sorted(mds) != list(range(grp.spec.tp_size)):
                self.fail("the metadata server stopped serving after hostile traffic")
        if "forged" in info:
            grp, before, sent = info["forged"]
            if id(grp) in self.dead:
                return
            deadline = time.monotonic() + 10
            while True:
                after = self._notif_counts(grp)
                short = {r: (after[r] - before[r], n) for r, n in sent.items() if after[r] - before[r] < n}
                if not short:
                    return
                if time.monotonic() > deadline:
                    self.fail(f"forged notifications not all refused (rank: refused, sent): {short}")
                self.cluster.drain(0.2)

    def _probe_once(self) -> dict[int, tuple]:
        """pid -> (label, /proc sample, handle counts, group, rank) of every live process."""
        out = {}
        for grp in (self.cluster.prefill, self.cluster.decode):
            stats = self.cluster.rank_stats(grp)
            for i, pid in enumerate(grp.pids):
                rank = grp.groups[i][0]
                out[pid] = (probe(pid), stats[rank], grp)
        return out

    def probe_all(self, done_requests: int, settle: bool = False) -> None:
        """Sample every live process. ``settle``: an engine was killed or restarted in the last
        two waves; the connections to its processes close asynchronously (the survivor's UCX
        worker notices the broken connection, the side-channel client's ZMQ I/O thread closes
        its sockets), so sample until fds and sockets read the same twice 0.25 s apart (at
        most :data:`SETTLE_S`). A transfer given up in progress (a frozen peer) is kept until
        it ends: sample until no rank keeps one; one still kept after :data:`KEPT_S` fails."""
        now = self._probe_once()
        t0 = time.monotonic()
        stable = not settle
        self.report.kept_waits += any(h["kept_transfers"] for _, (_, h), _ in now.values())
        while True:
            waited = time.monotonic() - t0
            kept = any(h["kept_transfers"] for _, (_, h), _ in now.values())
            if (stable or waited >= SETTLE_S) and (not kept or waited >= KEPT_S):
                break
            self.cluster.drain(0.25)
            again = self._probe_once()
            stable = again.keys() == now.keys() and all(
                (a[0].fds, a[0].sockets) == (now[pid][0].fds, now[pid][0].sockets)
                for pid, a in again.items())
            now = again
        for pid, (sample, (st, handles), grp) in now.items():
            if handles["kept_transfers"]:
                self.fail(f"{self.labels[pid]} still keeps {handles['kept_transfers']} given-up "
                          f"transfers {KEPT_S:.0f} s after the wave (they never end, or are not swept)")
            s = self.report.series.setdefault(pid, Series(self.labels[pid], pid))
            s.add(done_requests, sample, handles, self.departed[pid])
            if id(grp) in self.connected:
                self.connected_at.setdefault(pid, set()).add(done_requests)
            if grp.role == "p" and st.requests_released != self.held_by[id(grp)]:
                self.fail(f"{self.labels[pid]} released {st.requests_released} of "
                          f"{self.held_by[id(grp)]} requests it held")

    # ----- the run -----------------------------------------------------------
    def run(self) -> LaneReport:
        t0 = time.monotonic()
        c = self.cluster
        try:
            c.start()
            self._label(c.prefill)
            self._label(c.decode)
            probe_every = max(1, self.waves // 20)
            for w in range(self.waves):
                wave = self.submit_wave(w)
                infos = [self.inject(kind, wave) for kind in self.plan.get(w, [])]
                self.wait_wave(wave)
                self.judge(wave)
                for info in infos:
                    self.check_after(info)
                done = (w + 1) * WAVE
                if w == 0 or w % probe_every == 0 or w == self.waves - 1 or \
                        (done >= self.checkpoint > done - WAVE):
                    recent = self.plan.get(w, []) + self.plan.get(w - 1, [])
                    self.probe_all(min(done, self.requests), settle=bool(DEPARTING & set(recent)))
            if c.duplicates:
                self.fail(f"ranks reported requests twice: {c.duplicates[:5]}")
            lost = [r.rid for r in self.reqs.values() if r.outcome is None]
            if lost or len(self.reqs) != self.requests:
                self.fail(f"{len(lost)} requests without an outcome, {len(self.reqs)} submitted")
            self._flatness()
        finally:
            if self.frozen:
                try:
                    self.frozen[0].signal(self.frozen[1], signal.SIGCONT)
                except OSError:
                    pass
            c.close()
            self.report.wall_s = time.monotonic() - t0
        return self.report

    def _flatness(self) -> None:
        rep = self.report
        live = {pid for grp in (self.cluster.prefill, self.cluster.decode) for pid in grp.pids}
        for pid, s in rep.series.items():
            first = s.points[0][0]
            if pid in live and first <= self.checkpoint:  # survived from the checkpoint to the end
                rep.survivors.append(s.label)
                rep.problems += flatness_problems(s, self.checkpoint, RSS_TOL_KIB, LEFT_PER_PEER)
            elif len(s.points) >= 3:
                # a restarted incarnation: flat from its second sample on, and from the first one
                # that found it connected (it had completed a request with a peer engine that was
                # still alive): a process whose peer died before that, or died and was replaced
                # before the sample, was taken at a state without any peer connection
                at = sorted(self.connected_at.get(pid, set()) & {n for n, _ in s.points[1:]})
                if at and len(s.window(at[0])) >= 2:
                    start = at[0]
                    rep.restarted_checked += 1
                    rep.problems += flatness_problems(s, start, RSS_TOL_KIB, LEFT_PER_PEER)
        if rep.problems:
            self.fail("resources not flat:\n  " + "\n  ".join(rep.problems))


def _compat(grp: EngineGroup) -> str:
    from kvbridge.nixl.config import engine_compat_hash
    return engine_compat_hash(grp.spec, grp.config)


def run_once(args: argparse.Namespace, seed: int) -> bool:
    """One soak run with ``seed`` (lane ``i`` uses ``seed + i``); prints its table, True when it passed."""
    lanes = args.lanes.split(",")
    per_lane = max(WAVE * 4, args.requests // len(lanes))
    cp = args.checkpoint or min(1000, per_lane // 3)
    t0 = time.monotonic()
    reports, failure = [], None
    for i, name in enumerate(lanes):
        lane = Lane(name, per_lane, seed + i, cp)
        try:
            reports.append(lane.run())
        except SoakFailure as exc:
            failure = exc
            reports.append(lane.report)
            break
    print_table(reports, time.monotonic() - t0, LANES, BOUND_S)
    if failure is not None:
        print(f"SOAK FAILED (seed {seed}): {failure}", file=sys.stderr, flush=True)
        return False
    print(f"soak passed (seed {seed}): every requirement held", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="requests in all (split between lanes)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the soak this many times, run k with seed SEED + 100*k, and fail if "
                         "any run fails (every run is run; the failed seeds are listed at the end)")
    ap.add_argument("--lanes", default="pull,push")
    ap.add_argument("--checkpoint", type=int, default=None,
                    help="request from which resources must stay flat (default: 1000, or a third "
                         "of a lane's requests for short runs)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    t0 = time.monotonic()
    failed = []
    for k in range(args.repeat):
        seed = args.seed + 100 * k
        if args.repeat > 1:
            print(f"\n## soak run {k + 1} of {args.repeat}, seed {seed}\n", flush=True)
        if not run_once(args, seed):
            failed.append(seed)
    if args.repeat > 1:
        print(f"\n{args.repeat - len(failed)} of {args.repeat} soak runs passed in "
              f"{time.monotonic() - t0:.0f} s" + (f"; failed seeds: {failed}" if failed else ""),
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
