"""The decode rank: receives requests' blocks (pull: it READs them; push: prefill ranks WRITE them).

What both modes share lives here: the request tracker, failing and finishing
requests, post-processing received blocks, and the ``poll()`` round. The
mode-specific steps are the engine's ``mode`` object:
:class:`~kvbridge.nixl.pull.PullReads` or :class:`~kvbridge.nixl.push_receive.PushReceiver`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvbridge.memory import kernel_spec, post_process, rank_descriptors
from kvbridge.topology import (
    BlockIds,
    DecodeEvents,
    EngineSpec,
    FailureKind,
    HeadOrder,
    RankPlan,
    TransferParams,
    TransferPlan,
    plan_transfer,
)

from .agent import Transfer
from .groups import flat_ids, group_arrays
from .ledger import DecodeTracker, State
from .modes import DecodeMode, Load
from .peers import Peer
from .pull import PullReads
from .push_receive import PushReceiver
from .rank import RankEngine
from .staging import Staged, StagingArea, worth_staging

log = logging.getLogger("kvbridge.nixl")

_MODES: dict[str, type[DecodeMode]] = {"pull": PullReads, "push": PushReceiver}


class DecodeEngine(RankEngine):
    """One decode rank: loads requests' blocks from prefill engines (pull) or receives them (push)."""

    role = "d"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = DecodeTracker(self.stats)
        self._loads: dict[str, Load] = {}
        self._silent: set[str] = set()  # releases: notify-only loads nobody waits for
        self.mode: DecodeMode = _MODES[self.config.mode](self)
        #: pull mode, host memory: the buffer staged READs land in, made at the first handshake
        #: whose READs it serves (None: not made)
        self.staging: StagingArea | None = None
        self._staged_orphans: list[tuple[Transfer, Staged]] = []  # freed once NIXL releases them

    # ----- planning hooks ---------------------------------------------------
    def _busy(self) -> bool:
        # READs running or WRITEs awaited, or the owner stepped
        return bool(self._loads) or self.pending > 0 or super()._busy()

    def plan_for(self, peer_spec: EngineSpec) -> TransferPlan:
        return plan_transfer(kernel_spec(peer_spec), kernel_spec(self.spec))

    def rank_plan(self, plan: TransferPlan) -> RankPlan:
        """This rank's part of ``plan`` (its reads, source and notify-only ranks)."""
        return plan.decode_ranks[self.rank]

    def _peer_ranks(self, plan: TransferPlan) -> tuple[list[int], list[int]]:
        rp = self.rank_plan(plan)
        return list(rp.handshake_ranks), list(rp.source_ranks)

    def _descriptors(self, peer: Peer, q: int, plan: TransferPlan):
        rd = rank_descriptors(self.rank_plan(plan), q, self.geometry, self._remote_geometry(peer, q))
        c = self.config
        if (self.staging is None and c.mode == "pull" and c.mem_type == "DRAM" and c.staging_mib
                and worth_staging(rd.local_rows, rd.remote_rows)):  # worker thread, in the handshake
            geo = self.geometry
            staging = StagingArea(c.staging_mib << 20, list(zip(geo.base_addrs, geo.region_sizes, strict=True)),
                                  huge_pages=c.huge_pages)
            self.agent.register(staging.descs(), "DRAM")
            self.staging = staging
            log.info("rank %d: %d MiB staging buffer registered: READs from engine %s rank %d have "
                     "pieces scattered here and adjacent there", self.rank, c.staging_mib,
                     peer.engine_id, q)
        return rd, True

    # ----- public API -------------------------------------------------------
    def load(self, request_id: str, params: TransferParams, local_block_ids: BlockIds,
             computed_tokens: int = 0) -> None:
        """Start loading a request's blocks (pull mode). Never blocks on the peer.

        ``local_block_ids`` are this engine's blocks for the tokens from
        ``computed_tokens`` on (tokens already present locally: a prefix hit);
        ``params.block_ids`` are the prefill engine's blocks for all tokens. Both
        are :data:`~kvbridge.topology.BlockIds`: one tuple per group of
        ``EngineSpec.groups``, ``(ids,)`` for an engine with one group (see
        :mod:`kvbridge.nixl.groups` for how each group's blocks pair up).
        """
        groups = group_arrays(local_block_ids, len(self.groups), self.geometry.num_blocks, "local")
        lids = flat_ids(groups, self.config.null_block_id)
        if computed_tokens < 0 or computed_tokens % self.spec.block_size:
            raise ValueError(
                f"computed_tokens must be a non-negative multiple of the decode block size "
                f"{self.spec.block_size} (whole blocks already present), got {computed_tokens}"
            )
        self.mode.load(request_id, params, lids, computed_tokens, groups)
        self._worker.wake()

    def prepare(self, params: TransferParams) -> None:
        """Start the handshake with ``params``' prefill engine now, if it is not known yet.

        Lets a caller overlap the handshake with whatever precedes :meth:`load`
        (a request queued for local blocks). Never blocks on the peer.
        """
        self.mode.prepare(params)

    def renew(self, params: TransferParams) -> None:
        """Renew the prefill lease of a request this rank has not started loading yet.

        The RENEW notifications go out on the next :meth:`poll` once the
        handshake with that engine is done (it is started here if needed).
        Requests being loaded are renewed by the engine itself.
        """
        self.mode.renew(params)

    def release(self, params: TransferParams) -> None:
        """Tell the prefill ranks this rank will not read a request, so they free its blocks.

        For requests the caller dropped (aborted before loading, or fully
        present locally). Nothing is reported for it by :meth:`poll`; if the
        prefill engine cannot be reached its lease frees the blocks.
        """
        if not params.request_id:
            raise ValueError("release() needs params.request_id (the prefill-side request id)")
        self.mode.release(params)

    def expect(self, request_id: str, prefill_engine_id: str, prefill_tp: int, token: str,
               local_block_ids: BlockIds, *, prefill_block_size: int | None = None,
               prefill_head_order: HeadOrder | str | None = None,
               prefill_kernel_blocks_per_block: int | None = None) -> None:
        """Push mode: wait for the prefill ranks that write this rank's share of a request.

        The decode rank never handshakes in push mode, so the caller names the
        prefill engine's cache facts that decide how received blocks must be
        rearranged: ``prefill_block_size`` (tokens per logical block),
        ``prefill_head_order`` (``HND`` or ``NHD``) and
        ``prefill_kernel_blocks_per_block``. Left out, each is the decode
        engine's own value, except that ``prefill_kernel_blocks_per_block``
        defaults to 1 (not kernel-split) when ``prefill_block_size`` is given.
        The request is planned with these values; when the plan needs
        post-processing (HND <-> NHD, or several smaller prefill units per
        decode block holding several heads) the engine applies
        :func:`kvbridge.memory.post_process` to the request's blocks once every
        source rank has written, before reporting it done. Wrong values are not
        detected (push notifications do not carry the prefill geometry): the
        received blocks would be rearranged wrongly. Raises ``ValueError``
        (:class:`~kvbridge.topology.TopologyError`) when the pair cannot be planned.
        ``local_block_ids``: :data:`~kvbridge.topology.BlockIds`, one tuple per group.
        """
        groups = group_arrays(local_block_ids, len(self.groups), self.geometry.num_blocks, "local")
        lids = flat_ids(groups, self.config.null_block_id)
        self.mode.expect(request_id, prefill_engine_id, prefill_tp, token, lids, prefill_block_size,
                         prefill_head_order, prefill_kernel_blocks_per_block, groups)
        self._worker.wake()  # the prefill ranks' WRITEs need this side's progress

    def poll(self) -> DecodeEvents:
        """Advance handshakes, transfers, timeouts and lease renewals; return finished requests.

        Never waits: while the worker thread is inside a NIXL call, this round is skipped.
        """
        self._polled()
        self._events.clear()  # what is queued now is applied below or by the next round
        with self.agent.turn(wait=False) as mine:
            if mine:
                self._drain_events()
                self._release_transfers()
                self._reap_staging()
                self.mode.advance()
                now = time.monotonic()
                for t in self.tracker.overdue(now):
                    self.fail(t.request_id, FailureKind.TIMEOUT,
                               f"not complete within {self.config.transfer_timeout_s:.1f} s")
                self.mode.keep_alive(now)
        done, failed = self.tracker.take_done(), self.tracker.take_failed()
        if self._silent:
            quiet = self._silent
            self._silent = quiet - set(done) - {f.request_id for f in failed}
            done = [r for r in done if r not in quiet]
            failed = [f for f in failed if f.request_id not in quiet]
        return DecodeEvents(done, failed)

    @property
    def pending(self) -> int:
        """Requests loading or awaited (not reported done or failed yet)."""
        return len(self.tracker)

    # ----- requests: the surface the mode objects use ---------------------------------
    def add(self, ld: Load, now: float, ready: bool) -> None:
        """Track a new request (its deadline starts now; ``ready``: its peer is handshaken)."""
        self.tracker.add(ld.request_id, ld.peer.engine_id, ld.local_ids.tolist(),
                         now + self.config.transfer_timeout_s, ready=ready)
        self._loads[ld.request_id] = ld

    def load_of(self, request_id: str) -> Load | None:
        """The request being received under ``request_id`` (None: unknown, done or failed)."""
        return self._loads.get(request_id)

    def loads(self) -> list[Load]:
        """The requests being received, oldest first (a copy: failing one meanwhile is safe)."""
        return list(self._loads.values())

    def posted(self, ld: Load, parts: Iterable[int]) -> None:
        """``ld``'s transfers are under way from these source ranks (each reported with
        :meth:`part_done`); with none the request is done at once."""
        parts = list(parts)
        self.tracker.posted(ld.request_id, parts)
        if not parts:
            self._loads.pop(ld.request_id, None)

    def mute(self, request_id: str) -> None:
        """Never report ``request_id`` from :meth:`poll` (a release nobody waits for)."""
        self._silent.add(request_id)

    def fail(self, rid: str, kind: FailureKind, message: str) -> None:
        """Give a request up: release its transfers and report it failed (its local blocks
        invalid). Nothing happens for a request no longer tracked."""
        ld = self._loads.pop(rid, None)
        if ld is not None:
            if ld.unreported is not None:  # posted just now, its event not applied yet
                ld.transfers.update(ld.unreported[0])
                ld.staged.update(ld.unreported[1])
                ld.unreported = None
            self.drop_reads(ld.transfers, ld.staged)
            ld.staged.clear()
            ld.transfers.clear()
        if rid in self.tracker:
            self.tracker.fail(rid, kind, message)

    def part_done(self, ld: Load, part: int) -> None:
        """One source rank of ``ld`` finished (pull: its READ completed; push: it wrote).

        On the last one the request's blocks are post-processed before the
        request is reported done; if that fails the request fails instead.
        """
        rid = ld.request_id
        t = self.tracker.get(rid)
        try:
            if not self._staged_in_place(ld, part, t):
                return  # the copy thread is still copying: checked again on the next poll()
        except Exception as exc:  # noqa: BLE001 - a failed copy leaves garbage: recompute
            self.fail(rid, FailureKind.POST, f"copying staged blocks into place failed: {exc}")
            return
        if t is None or t.state is not State.POSTED or part not in t.outstanding:
            return
        if len(t.outstanding) == 1:  # the last part: rearrange before anyone sees "done"
            try:
                self._post_process(ld)
            except Exception as exc:  # a failed rearrangement leaves garbage: recompute the blocks
                self.fail(rid, FailureKind.POST, f"post-processing the received blocks failed: {exc}")
                return
        if self.tracker.part_done(rid, part):
            self._loads.pop(rid, None)

    def _staged_in_place(self, ld: Load, part: int, t) -> bool:
        """Whether ``part``'s pieces are in place (its READ complete): True when it was not
        staged or its copy is done (copied here if nobody took it; not for a request ``t`` no
        longer posted), False while the copy thread copies it (``ld.copying``). Raises what
        the copy raised."""
        st = ld.staged.get(part)
        if st is None:
            return True
        if self.staging.claim(st):
            if t is not None and t.state is State.POSTED:
                self.staging.scatter(st)
        elif st.future is None or not st.future.done():
            ld.copying.add(part)
            return False
        ld.staged.pop(part)
        ld.copying.discard(part)
        self.staging.free(st)
        self.stats.staged_copy_us += st.copy_us
        if st.future is not None:
            st.future.result()
        return True

    def drop_reads(self, transfers: dict[int, Transfer], staged: dict[int, Staged]) -> None:
        """Give up READs (by source rank): release their handles (:meth:`drop_transfers`) and
        free the staging bytes of those staged, at once where the READ is released (or already
        gone), else once NIXL releases it (checked on every ``poll()``)."""
        self.drop_transfers(transfers.values())
        for q, st in staged.items():
            x = transfers.get(q)
            if not self.staging.claim(st) and st.future is not None:
                st.future.exception()  # a copy under way ends before its blocks are given up
            if x is None or x.released:
                self.staging.free(st)
            else:
                self._staged_orphans.append((x, st))

    def _reap_staging(self) -> None:
        if self._staged_orphans:
            keep = []
            for x, st in self._staged_orphans:
                if x.released:
                    self.staging.free(st)
                else:
                    keep.append((x, st))
            self._staged_orphans = keep

    def resource_counts(self) -> dict[str, int]:
        """:meth:`RankEngine.resource_counts`, with the staging buffer's prepared lists (one per
        piece size, kept while the engine lives) as ``staging_lists`` instead of in ``lists``."""
        c = super().resource_counts()
        c["staging_lists"] = self.staging.lists if self.staging is not None else 0
        c["lists"] -= c["staging_lists"]
        return c

    def close(self) -> None:
        super().close()
        if self.staging is not None:
            self.staging.close()

    def _post_process(self, ld: Load) -> None:
        """Rearrange a completed request's blocks in place when the plan says so
        (HND <-> NHD, several smaller prefill blocks per decode block)."""
        pp = ld.peer.plan.post_process
        ids = flat_ids(ld.groups, self.config.null_block_id, self.groups, attention_only=True)
        if pp.needed and ids.size:
            post_process(self.regions, ids, pp, self.spec)
