"""Per-local-engine registry of the remote engines it transfers with."""

from __future__ import annotations

from .errors import TopologyError
from .plan import RankPlan, check_compatible, plan_rank
from .spec import EngineSpec


class RemoteEngineRegistry:
    """Remote engines known to one local engine, each planned once.

    Not thread-safe; the owning engine serialises access. Registering the
    local engine's own id, or an id already registered with different facts,
    is an error: an engine that restarted with a new shape must be dropped
    (:meth:`forget`) before it is registered again.
    """

    def __init__(self, local: EngineSpec) -> None:
        self._local = local
        self._remotes: dict[str, EngineSpec] = {}
        self._plans: dict[tuple[str, int], RankPlan] = {}

    @property
    def local(self) -> EngineSpec:
        return self._local

    def register(self, remote: EngineSpec) -> bool:
        """Register ``remote``; True if new, False if already known with equal facts."""
        if remote.engine_id == self._local.engine_id:
            raise TopologyError(
                f"remote engine id {remote.engine_id!r} is the local engine's own id; "
                "every engine needs a distinct engine id"
            )
        known = self._remotes.get(remote.engine_id)
        if known is not None:
            if known != remote:
                raise TopologyError(
                    f"engine {remote.engine_id!r} is already registered with different facts; "
                    "forget() it first if it restarted with a new shape"
                )
            return False
        check_compatible(self._local, remote)
        self._remotes[remote.engine_id] = remote
        return True

    def forget(self, engine_id: str) -> None:
        """Drop a remote engine and its cached plans (no error if unknown)."""
        self._remotes.pop(engine_id, None)
        for key in [k for k in self._plans if k[0] == engine_id]:
            del self._plans[key]

    def get(self, engine_id: str) -> EngineSpec:
        try:
            return self._remotes[engine_id]
        except KeyError:
            raise TopologyError(f"remote engine {engine_id!r} is not registered") from None

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._remotes

    def __len__(self) -> int:
        return len(self._remotes)

    def engine_ids(self) -> tuple[str, ...]:
        return tuple(self._remotes)

    def plan(self, engine_id: str, local_rank: int) -> RankPlan:
        """The (cached) plan of ``local_rank`` against a registered remote engine."""
        key = (engine_id, local_rank)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_rank(self._local, self.get(engine_id), local_rank)
            self._plans[key] = plan
        return plan
