"""The prefill rank: holds requests' blocks until the decode side has them.

Pull mode: :meth:`PrefillEngine.hold` puts a request in the lease ledger
(:class:`~kvbridge.nixl.ledger.PrefillLedger`); DONE notifications from the
assigned decode ranks, or the lease lapsing, release it. Push mode:
:meth:`PrefillEngine.push` writes the request into a decode engine
(:class:`~kvbridge.nixl.push.PushWrites`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvbridge.memory import kernel_spec, rank_descriptors
from kvbridge.topology import (
    BlockIds,
    EngineSpec,
    Released,
    TransferParams,
    TransferPlan,
    plan_transfer,
)

from .config import provisional_spec
from .groups import flat_ids, group_arrays
from .ledger import PrefillLedger
from .messages import new_token, parse_notification
from .modes import PrefillMode
from .peers import Peer
from .pull import PullLeases
from .push import PushWrites
from .rank import RankEngine

log = logging.getLogger("kvbridge.nixl")

_MODES: dict[str, type[PrefillMode]] = {"pull": PullLeases, "push": PushWrites}


class PrefillEngine(RankEngine):
    """One prefill rank: holds requests' blocks until the decode side has them."""

    role = "p"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = PrefillLedger(self._consumers_for, self.config.lease_s, self.stats)
        self.mode: PrefillMode = _MODES[self.config.mode](self)

    def _busy(self) -> bool:
        # a decode rank may read held blocks (or pushes are in flight), or the owner stepped
        return self.held > 0 or super()._busy()

    def _consumers_for(self, decode_tp: int) -> tuple[int, ...]:
        """The decode ranks (of a decode engine with TP ``decode_tp``) that notify this rank."""
        plan = plan_transfer(self.spec, provisional_spec(self.spec, self.spec.engine_id + "#decode", decode_tp))
        return plan.prefill_ranks[self.rank].consumer_ranks

    # planning hooks (push mode: the peer is a decode engine)
    def plan_for(self, peer_spec: EngineSpec) -> TransferPlan:
        return plan_transfer(kernel_spec(self.spec), kernel_spec(peer_spec))

    def _peer_ranks(self, plan: TransferPlan) -> tuple[list[int], list[int]]:
        read_by = list(plan.prefill_ranks[self.rank].read_by)
        return read_by, read_by

    def _descriptors(self, peer: Peer, r: int, plan: TransferPlan):
        # the plan's local side is the decode rank r; this rank is its remote side
        return rank_descriptors(plan.decode_ranks[r], self.rank, self._remote_geometry(peer, r),
                                self.geometry), False

    # ----- public API -------------------------------------------------------
    def hold(self, request_id: str, block_ids: BlockIds, token: str | None = None) -> TransferParams:
        """Hold a request's blocks under a lease; returns the parameters for the decode side.

        ``block_ids``: :data:`~kvbridge.topology.BlockIds`, one tuple per group of
        ``EngineSpec.groups`` (``(ids,)`` for an engine with one group); the parameters
        carry them in that form. The lease ledger and :class:`Released` list every
        group's ids in one tuple.
        All ranks of one engine must hold a request with the same token: pass
        rank 0's token to the others (or one from :func:`new_token`).
        """
        groups = group_arrays(block_ids, len(self.groups), self.geometry.num_blocks, "prefill")
        token = token or new_token()
        self.mode.hold(request_id, tuple(flat_ids(groups, None).tolist()), token, time.monotonic())
        self._worker.wake()  # the decode ranks' READs need this side's progress from now on
        host, port = self.address
        return TransferParams(self.spec.engine_id, host, port, self.spec.tp_size,
                              tuple(tuple(g.tolist()) for g in groups), token, self.incarnation,
                              request_id)

    def push(self, request_id: str, block_ids: BlockIds, target: TransferParams) -> None:
        """Push mode: write a request's blocks into the decode engine ``target`` (its address,
        TP size, blocks, token and ``computed_tokens``). Block ids here and in ``target``:
        :data:`~kvbridge.topology.BlockIds`, one tuple per KV-cache group."""
        groups = group_arrays(block_ids, len(self.groups), self.geometry.num_blocks, "prefill")
        self.mode.push(request_id, groups, target)
        self._worker.wake()

    def push_start(self, request_id: str, block_ids: BlockIds, target: TransferParams) -> None:
        """Push mode, layer by layer: open the push of a request whose KV is still being
        computed. Name each layer with :meth:`push_layers` as soon as it is in the cache
        (its WRITEs are posted at once, on the engine's worker thread, so a forward pass
        overlaps them), then call :meth:`push_finish`. The handshake with the decode engine
        starts now if it is not known yet; layers named before it completes are written
        once it does. The Mamba state of a hybrid model is written by :meth:`push_finish`.
        Never blocks on the peer."""
        groups = group_arrays(block_ids, len(self.groups), self.geometry.num_blocks, "prefill")
        self.mode.start(request_id, groups, target)
        self._worker.wake()

    def push_layers(self, request_id: str, layers: Sequence[int]) -> None:
        """Write these layers (indices in model order) of an open layered push now;
        layers already written are skipped."""
        self.mode.write_layers(request_id, tuple(layers))

    def push_finish(self, request_id: str) -> None:
        """No more layers will be named: the layers not written yet are written now, and
        each decode rank is notified once every WRITE of the request completed. The
        request is released (reported by :meth:`poll`) after that, or when it fails."""
        self.mode.finish(request_id)

    def poll(self) -> list[Released]:
        """Count notifications, expire leases, advance pushes; returns requests whose blocks are free."""
        self._polled()
        self._drain_events()
        self._release_transfers()
        now = time.monotonic()
        for sender, msgs in self.agent.notifications().items():
            for raw in msgs:
                outcome = self.ledger.on_notification(parse_notification(raw, self.notif_key), now)
                if outcome in ("unknown", "bad-token", "malformed", "bad-decode-tp", "unassigned",
                               "unauthenticated"):
                    log.debug("ignored notification from %s: %s", sender, outcome)
        for rid in self.ledger.expire(now):
            log.warning("request %s: lease of %.1f s lapsed before every decode rank read it; "
                        "releasing its blocks", rid, self.config.lease_s)
        return self.ledger.take_released() + self.mode.poll(now)

    @property
    def held(self) -> int:
        """Requests whose blocks this rank still holds."""
        return len(self.ledger) + self.mode.held
