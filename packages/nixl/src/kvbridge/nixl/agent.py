"""A thin, typed wrapper over one NIXL agent (``nixl._api.nixl_agent``).

One :class:`NixlAgent` belongs to one TP rank. It owns everything it creates
(registrations, prepared lists, transfer handles, remote agents) and releases
all of it on :meth:`close`. NIXL agents are not thread-safe in their default
sync mode, so every call into NIXL goes through one re-entrant lock: a
background handshake thread and the engine's polling thread can share an agent.

Facts this wrapper relies on (checked by ``tests/test_agent.py`` on real UCX):

* ``prep_xfer_dlist`` takes an N x 3 ``uint64`` array ``(addr, len, dev)`` or an
  N x 5 array ``(addr, len, dev, stride, count)``; index ``i`` of a strided list
  is the ``i``-th expanded descriptor (row-major, then count).
* ``make_prepped_xfer`` takes ``int32`` index arrays; ``transfer`` returns
  ``"DONE"``, ``"PROC"`` or ``"ERR"``; ``check_xfer_state`` likewise.
* ``add_remote_agent`` returns the remote agent name as ``bytes``.
* ``get_new_notifs`` returns ``{agent_name: [bytes, ...]}``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvbridge.memory import expand_strided

from .agent_config import AgentConfig, build_agent

log = logging.getLogger("kvbridge.nixl")

XferState = Literal["DONE", "PROC", "ERR"]
MemType = Literal["DRAM", "VRAM"]


class NixlError(RuntimeError):
    """A NIXL call failed; the message names the operation and the peer."""


class _PrepRefused(NixlError):
    """NIXL refused to prepare a descriptor list (callers see a NixlError)."""


@dataclass(frozen=True)
class Telemetry:
    """NIXL's per-transfer telemetry (times in microseconds)."""

    start_us: int
    post_us: int
    xfer_us: int
    bytes: int
    descriptors: int


class PreparedList:
    """A prepared descriptor list (``prep_xfer_dlist``) owned by a :class:`NixlAgent`."""

    __slots__ = ("handle", "peer", "num_descs", "strided", "_owner")

    def __init__(self, owner: NixlAgent, handle: object, peer: str | None, num_descs: int,
                 strided: bool) -> None:
        self.handle = handle  # NIXL's handle (None once released); only the owning agent uses it
        self._owner = owner
        self.peer = peer  # None: local side
        self.num_descs = num_descs
        self.strided = strided

    @property
    def released(self) -> bool:
        return self.handle is None

    def release(self) -> None:
        self._owner.release_list(self)


class Transfer:
    """One prepared transfer request (``make_prepped_xfer``) owned by a :class:`NixlAgent`."""

    __slots__ = ("handle", "peer", "op", "num_descs", "done", "_owner")

    def __init__(self, owner: NixlAgent, handle: object, peer: str, op: str, num_descs: int) -> None:
        self.handle = handle  # NIXL's handle (None once released); only the owning agent uses it
        self._owner = owner
        self.peer = peer
        self.op = op
        self.num_descs = num_descs
        #: a check saw this posting complete: later checks answer "DONE" without asking NIXL
        #: (a completed transfer stays complete until it is posted again)
        self.done = False

    @property
    def released(self) -> bool:
        return self.handle is None

    def release(self) -> bool:
        return self._owner.release_transfer(self)


def descs_array(rows: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
    """A C-contiguous uint64 N x 3 or N x 5 descriptor array, validated."""
    arr = np.ascontiguousarray(rows, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] not in (3, 5):
        raise ValueError(f"descriptor arrays must be N x 3 or N x 5, got shape {arr.shape}")
    return arr


class NixlAgent:
    """One rank's NIXL agent with every resource it creates tracked and released on close."""

    LOCAL = "NIXL_INIT_AGENT"

    def __init__(self, name: str, config: AgentConfig | None = None, mem_type: MemType = "DRAM") -> None:
        """``mem_type``: the memory the agent will register (GPU memory gets UCX settings of
        its own, :data:`~kvbridge.nixl.agent_config.GPU_UCX_SETTINGS`)."""
        self.config = config or AgentConfig()
        self.name = name
        self._lock = threading.RLock()
        try:
            self._agent = build_agent(name, self.config, mem_type)
        except Exception as exc:
            raise NixlError(f"creating NIXL agent {name!r} failed: {exc}") from exc
        missing = [b for b in self.config.backends if b not in self._agent.backends]
        if missing:
            raise NixlError(
                f"NIXL backends {missing} are not available (plugins: {self._agent.get_plugin_list()}); "
                "choose backends from that list"
            )
        self._registrations: list[object] = []
        self._lists: set[PreparedList] = set()
        self._transfers: set[Transfer] = set()
        self._transfers_peak = 0
        self._remotes: set[str] = set()
        self._closed = False
        self._strided_ok: bool | None = None
        self._pending: dict[str, list[bytes]] = {}
        self._pending_count = 0
        self.dropped_notifications = 0

    # ----- introspection ----------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def counts(self) -> dict[str, int]:
        """Live resources: registrations, prepared lists, transfer handles, remote agents."""
        with self._lock:
            return {
                "registrations": len(self._registrations),
                "lists": len(self._lists),
                "transfers": len(self._transfers),
                "remote_agents": len(self._remotes),
            }

    def take_transfers_peak(self) -> int:
        """The most transfer handles alive at once since the last call (or since the agent was
        made), and start counting again from the handles alive now."""
        with self._lock:
            peak, self._transfers_peak = self._transfers_peak, len(self._transfers)
            return peak

    @property
    def remote_agents(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._remotes)

    @contextmanager
    def turn(self, wait: bool = True) -> Iterator[bool]:
        """Hold this agent for a sequence of calls no other thread may interleave with.

        Yields True while held. With ``wait=False`` it yields False at once, holding
        nothing, when another thread is inside a NIXL call: a caller that must never
        block (an engine's ``poll()``) skips its round instead.
        """
        got = self._lock.acquire(blocking=wait)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def _check(self) -> None:
        if self._closed:
            raise NixlError(f"NIXL agent {self.name!r} is closed")

    # ----- memory -----------------------------------------------------------
    def register(self, descs: np.ndarray | Sequence[Sequence[int]], mem_type: MemType = "DRAM") -> None:
        """Register N x 3 ``(addr, len, device)`` regions with every backend."""
        arr = descs_array(descs)
        if arr.shape[1] != 3:
            raise ValueError("register() takes N x 3 (address, length, device) rows")
        if arr.shape[0] == 0:
            raise ValueError("register() needs at least one region")
        with self._lock:
            self._check()
            try:
                reg = self._agent.register_memory(arr, mem_type)
            except Exception as exc:
                raise NixlError(f"agent {self.name!r}: registering {arr.shape[0]} regions failed: {exc}") from exc
            self._registrations.append(reg)

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations) for peers."""
        with self._lock:
            self._check()
            return bytes(self._agent.get_agent_metadata())

    # ----- peers ------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        with self._lock:
            self._check()
            try:
                raw = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlError(f"agent {self.name!r}: loading remote agent metadata failed: {exc}") from exc
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._remotes.add(name)
            return name

    def connect(self, name: str) -> None:
        """Start connecting to a loaded peer now rather than on the first transfer (best effort)."""
        with self._lock:
            self._check()
            try:
                self._agent.make_connection(name)
            except Exception as exc:  # the first transfer will connect (or fail) instead
                log.debug("make_connection(%s) failed: %s", name, exc)

    def remove_remote(self, name: str) -> None:
        """Forget a peer: release transfers and lists bound to it, then invalidate its metadata."""
        with self._lock:
            if self._closed:
                return
            for t in [t for t in self._transfers if t.peer == name]:
                self.release_transfer(t)
            for lst in [lst for lst in self._lists if lst.peer == name]:
                self.release_list(lst)
            if name in self._remotes:
                self._remotes.discard(name)
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:  # noqa: S110 - a dead peer may already be gone
                    pass

    # ----- prepared lists ---------------------------------------------------
    def prepare(self, peer: str | None, descs: np.ndarray, mem_type: MemType = "DRAM",
                allow_strided: bool = True) -> PreparedList:
        """Prepare a descriptor list for ``peer`` (None: the local side).

        N x 5 arrays are passed as strided lists when this NIXL accepts them;
        otherwise (or with ``allow_strided=False``) they are expanded to N x 3.
        """
        arr = descs_array(descs)
        strided = arr.shape[1] == 5
        n = int(arr[:, 4].sum()) if strided else arr.shape[0]
        if strided and allow_strided and self._strided_ok is not False:
            try:
                lst = self._prep(peer, arr, mem_type, n, strided=True)
            except _PrepRefused:
                self._strided_ok = False  # this NIXL takes no strided rows: expand from now on
            else:
                self._strided_ok = True
                return lst
        if strided:
            arr = expand_strided(arr)
        return self._prep(peer, arr, mem_type, n, strided=False)

    def prepare_tuples(self, peer: str | None, descs: Sequence[tuple[int, int, int]],
                       mem_type: MemType = "DRAM") -> PreparedList:
        """Prepare a list from per-descriptor ``(addr, len, device)`` tuples, handed to NIXL as
        they are (NIXL's per-block Python path; ``kvbridge bench`` measures it as the naive
        baseline of :meth:`prepare`)."""
        return self._prep(peer, descs, mem_type, len(descs), strided=False)

    def _prep(self, peer: str | None, descs: object, mem_type: MemType, n: int, *,
              strided: bool) -> PreparedList:
        """The one path into ``prep_xfer_dlist``: checks the peer, tracks the list."""
        target = self.LOCAL if peer is None else peer
        with self._lock:
            self._check()
            if peer is not None and peer not in self._remotes:
                raise NixlError(f"agent {self.name!r}: no remote agent {peer!r}; add its metadata first")
            try:
                h = self._agent.prep_xfer_dlist(target, descs, mem_type)
            except Exception as exc:
                raise _PrepRefused(
                    f"agent {self.name!r}: preparing {n} descriptors for {target!r} failed: {exc}"
                ) from exc
            lst = PreparedList(self, h, peer, n, strided)
            self._lists.add(lst)
            return lst

    def release_list(self, lst: PreparedList) -> None:
        with self._lock:
            if lst.handle is None:
                return
            h, lst.handle = lst.handle, None
            self._lists.discard(lst)
            if self._closed:
                return
            try:
                h.release()
            except Exception:  # noqa: S110 - best effort; the agent frees it at teardown
                pass

    # ----- transfers --------------------------------------------------------
    def make_transfer(self, op: Literal["READ", "WRITE"], local: PreparedList, local_idx: np.ndarray,
                      remote: PreparedList, remote_idx: np.ndarray, notif: bytes = b"") -> Transfer:
        """Build a transfer of the selected descriptors (int32 index arrays of equal length)."""
        li = np.ascontiguousarray(local_idx, dtype=np.int32)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int32)
        if li.shape != ri.shape or li.ndim != 1:
            raise ValueError(f"index arrays must be 1-D and equal length, got {li.shape} and {ri.shape}")
        if remote.peer is None:
            raise ValueError("the remote side of a transfer must be a list prepared for a peer")
        with self._lock:
            self._check()
            if local.released or remote.released:
                raise NixlError("cannot build a transfer from a released prepared list")
            try:
                h = self._agent.make_prepped_xfer(op, local.handle, li, remote.handle, ri, notif)
            except Exception as exc:
                raise NixlError(
                    f"agent {self.name!r}: building a {op} of {li.size} descriptors with "
                    f"{remote.peer!r} failed: {exc}"
                ) from exc
            t = Transfer(self, h, remote.peer, op, int(li.size))
            self._transfers.add(t)
            self._transfers_peak = max(self._transfers_peak, len(self._transfers))
            return t

    def post(self, t: Transfer) -> XferState:
        with self._lock:
            self._check()
            if t.released:
                raise NixlError("cannot post a released transfer")
            t.done = False
            try:
                return self._agent.transfer(t.handle)
            except Exception as exc:
                raise NixlError(f"agent {self.name!r}: posting a {t.op} to {t.peer!r} failed: {exc}") from exc

    def state(self, t: Transfer) -> XferState:
        """NIXL's state of a posted transfer ("ERR" once released). A completion once seen
        is remembered, so that checking finished transfers again costs no NIXL call."""
        if t.done and t.handle is not None and not self._closed:
            return "DONE"
        with self._lock:
            self._check()
            try:
                st = self._agent.check_xfer_state(t.handle)
            except Exception:
                return "ERR"
            t.done = st == "DONE"
            return st

    def telemetry(self, t: Transfer) -> Telemetry | None:
        if not self.config.telemetry:
            return None
        with self._lock:
            try:
                tel = self._agent.get_xfer_telemetry(t.handle)
            except Exception:
                return None
            return Telemetry(int(tel.startTime), int(tel.postDuration), int(tel.xferDuration),
                             int(tel.totalBytes), int(tel.descCount))

    def release_transfer(self, t: Transfer) -> bool:
        """Release a transfer handle; False when NIXL refused (an active transfer it cannot cancel)."""
        with self._lock:
            if t.handle is None:
                return True
            if self._closed:
                t.handle = None
                self._transfers.discard(t)
                return True
            try:
                t.handle.release()
            except Exception:
                return False
            t.handle = None
            self._transfers.discard(t)
            return True

    # ----- notifications ----------------------------------------------------
    #: notifications kept between progress() and notifications() calls, at most
    MAX_PENDING_NOTIFICATIONS = 65536

    def _stash(self, raw: dict) -> None:
        for k, v in raw.items():
            key = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
            for m in v:
                if self._pending_count >= self.MAX_PENDING_NOTIFICATIONS:
                    self.dropped_notifications += 1
                    continue
                self._pending.setdefault(key, []).append(bytes(m))
                self._pending_count += 1

    def progress(self) -> None:
        """Let NIXL make progress (connection set-up with peers, incoming notifications)
        without its progress thread; what arrives is kept for :meth:`notifications`
        (at most ``MAX_PENDING_NOTIFICATIONS``, the excess is counted in
        ``dropped_notifications``). A no-op after :meth:`close`."""
        with self._lock:
            if self._closed:
                return
            self._stash(self._agent.get_new_notifs())

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sending agent name."""
        with self._lock:
            self._check()
            self._stash(self._agent.get_new_notifs())
            out, self._pending, self._pending_count = self._pending, {}, 0
        return out

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._check()
            if peer not in self._remotes:
                raise NixlError(f"agent {self.name!r}: no remote agent {peer!r} to notify")
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:
                raise NixlError(f"agent {self.name!r}: notifying {peer!r} failed: {exc}") from exc

    # ----- teardown ---------------------------------------------------------
    def close(self) -> None:
        """Release transfers, prepared lists, remote agents and registrations (idempotent)."""
        with self._lock:
            if self._closed:
                return
            for t in list(self._transfers):
                self.release_transfer(t)
            for lst in list(self._lists):
                self.release_list(lst)
            for name in list(self._remotes):
                self.remove_remote(name)
            for reg in self._registrations:
                try:
                    self._agent.deregister_memory(reg)
                except Exception:  # noqa: S110 - teardown is best effort
                    pass
            self._registrations.clear()
            self._transfers.clear()
            self._closed = True
            self._agent = None  # drops the C++ agent

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
