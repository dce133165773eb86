"""Instances and their state: in-flight counts, health, least-loaded or prefix-aware choice (no I/O).

The router runs on one asyncio event loop, so this state needs no locks: every
change happens between two awaits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .ring import VNODES, HashRing, PrefixKey


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

    With a :class:`Placement` (prefix-aware placement), a request that brings
    a key goes to the key's owner on a hash ring of all the pool's instances,
    or, when the owner is out of rotation, excluded, or busier than the least
    loaded candidate by more than ``placement.load_margin`` requests, to the
    next instance on the ring that is none of these. An instance out of
    rotation keeps its points on the ring, so only its own keys move while it
    is out, and they come back with it.
    """

    role: str
    instances: list[Instance]
    on_change: Callable[[Instance], None] = lambda _i: None
    unhealthy_after: int = 1
    placement: Placement | None = None
    _turn: int = field(default=0, repr=False)
    _ring: HashRing | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.placement is not None:
            self._ring = HashRing((i.url for i in self.instances), self.placement.vnodes)

    @classmethod
    def of(cls, role: str, urls: Iterable[str], on_change: Callable[[Instance], None] | None = None,
           *, unhealthy_after: int = 1, placement: Placement | None = None) -> Pool:
        pool = cls(role, [Instance(u, role) for u in urls], unhealthy_after=unhealthy_after,
                   placement=placement)
        if on_change is not None:
            pool.on_change = on_change
        for inst in pool.instances:
            pool.on_change(inst)
        return pool

    def __len__(self) -> int:
        return len(self.instances)

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def prefix_key(self, body: Mapping[str, Any]) -> bytes | None:
        """The placement key of a request body; None when this pool places by load alone."""
        return None if self.placement is None else self.placement.key.of(body)

    def choose(self, exclude: Iterable[Instance] = (), *, any_health: bool = False,
               key: bytes | None = None) -> Instance | None:
        """The least-loaded healthy instance not in ``exclude``; None when there is none.

        With ``any_health`` an instance that is out of rotation may be chosen
        too (a last resort when no healthy one is left: it may have recovered
        since its last probe). With a ``key`` (see :meth:`prefix_key`) and a
        placement, the key's instance on the ring unless it is too busy."""
        if key is not None and self._ring is not None and self.placement is not None:
            return self._choose_on_ring(self.placement.load_margin, key, exclude, any_health)
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

    def ring_order(self, key: bytes) -> list[Instance]:
        """Every instance in ring order for ``key``, its owner first (health and load aside);
        empty without a placement."""
        if self._ring is None:
            return []
        by_url = {i.url: i for i in self.instances}
        return [by_url[u] for u in self._ring.walk(key)]

    def _choose_on_ring(self, load_margin: int, key: bytes, exclude: Iterable[Instance],
                        any_health: bool) -> Instance | None:
        skip = {id(i) for i in exclude}
        order = self.ring_order(key)
        candidates = [i for i in order if (i.healthy or any_health) and id(i) not in skip]
        if not candidates:
            return None
        bound = min(i.in_flight for i in candidates) + load_margin
        return next(i for i in candidates if i.in_flight <= bound)

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


@dataclass(frozen=True)
class Placement:
    """Prefix-aware placement for one pool: how keys are read, how much imbalance is tolerated.

    ``load_margin``: the key's instance is passed over when it has more than
    this many requests in flight beyond the least-loaded candidate (0: only
    when it is not among the least loaded). ``vnodes``: ring points per
    instance."""

    key: PrefixKey = PrefixKey()
    load_margin: int = 8
    vnodes: int = VNODES

    def __post_init__(self) -> None:
        if not isinstance(self.load_margin, int) or isinstance(self.load_margin, bool) \
                or self.load_margin < 0:
            raise ValueError(f"load_margin must be a non-negative integer, got {self.load_margin!r}")
