"""Instances and their state: in-flight counts, health, least-loaded choice (no I/O).

The router runs on one asyncio event loop, so this state needs no locks: every
change happens between two awaits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Instance:
    """One upstream OpenAI server in one role."""

    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    in_flight: int = 0
    failures: int = 0  # consecutive failures seen by requests or probes
    last_error: str = ""

    def snapshot(self) -> dict[str, object]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "in_flight": self.in_flight, "last_error": self.last_error}


@dataclass
class Pool:
    """The instances of one role.

    :meth:`choose` picks the healthy instance with the fewest requests in
    flight, skipping ``exclude``; ties go round-robin so that equal instances
    share the load. ``on_change`` is called with an instance whenever its
    in-flight count or health changes (the metrics follow it).

    A request that cannot connect takes its instance out at once; health
    probes take it out only after ``unhealthy_after`` failures in a row (one
    slow answer from a busy engine is no proof that it is gone). Any answer,
    probe or request, puts it back.
    """

    role: str
    instances: list[Instance]
    on_change: Callable[[Instance], None] = lambda _i: None
    unhealthy_after: int = 1
    _turn: int = field(default=0, repr=False)

    @classmethod
    def of(cls, role: str, urls: Iterable[str], on_change: Callable[[Instance], None] | None = None,
           *, unhealthy_after: int = 1) -> Pool:
        pool = cls(role, [Instance(u, role) for u in urls], unhealthy_after=unhealthy_after)
        if on_change is not None:
            pool.on_change = on_change
        for inst in pool.instances:
            pool.on_change(inst)
        return pool

    def __len__(self) -> int:
        return len(self.instances)

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def choose(self, exclude: Iterable[Instance] = (), *, any_health: bool = False) -> Instance | None:
        """The least-loaded healthy instance not in ``exclude``; None when there is none.

        With ``any_health`` an instance that is out of rotation may be chosen
        too (a last resort when no healthy one is left: it may have recovered
        since its last probe)."""
        skip = {id(i) for i in exclude}
        n = len(self.instances)
        best: Instance | None = None
        for k in range(n):
            inst = self.instances[(self._turn + k) % n]
            if not (inst.healthy or any_health) or id(inst) in skip:
                continue
            if best is None or inst.in_flight < best.in_flight:
                best = inst
        if best is not None:
            self._turn = (self.instances.index(best) + 1) % n
        return best

    @contextmanager
    def using(self, inst: Instance) -> Iterator[Instance]:
        """Count one request in flight on ``inst`` for the duration of the block."""
        inst.in_flight += 1
        self.on_change(inst)
        try:
            yield inst
        finally:
            inst.in_flight -= 1
            self.on_change(inst)

    def mark_failed(self, inst: Instance, why: str) -> None:
        """A request could not reach ``inst`` (connection refused, timeout): take it out
        until a health probe answers again."""
        inst.failures += 1
        inst.last_error = why
        if inst.healthy:
            inst.healthy = False
            self.on_change(inst)

    def mark_ok(self, inst: Instance) -> bool:
        """``inst`` answered a request: back in rotation. True when its health changed."""
        return self.mark_probe(inst, True)

    def mark_probe(self, inst: Instance, ok: bool, why: str = "") -> bool:
        """Record a health probe; returns True when the instance's health changed.

        A failed probe takes the instance out only once ``unhealthy_after``
        probes or requests in a row have failed."""
        if ok:
            inst.failures = 0
            healthy = True
        else:
            inst.failures += 1
            inst.last_error = why
            healthy = inst.healthy and inst.failures < self.unhealthy_after
        changed = inst.healthy != healthy
        inst.healthy = healthy
        if changed:
            self.on_change(inst)
        return changed

    def describe_down(self) -> str:
        """Why the instances out of rotation are out (for error messages)."""
        return "; ".join(f"{i.url}: {i.last_error or 'out of rotation'}"
                         for i in self.instances if not i.healthy)
