"""Pull or push, chosen once per engine: the interface each transfer direction implements.

An engine picks its mode object from ``EngineConfig.mode`` when it is built
(:mod:`kvbridge.nixl.pull` or :mod:`kvbridge.nixl.push`) and delegates every
mode-specific step to it; nothing else in the engine asks which mode it is in.
The base classes here answer every entry point of the other mode with a clear
error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvbridge.topology import Released, TransferParams

from .agent import Transfer
from .peers import Peer
from .rank import RankEngine
from .staging import Staged


@dataclass(eq=False)
class Load:
    """One request a decode rank receives (pull: READs it posts; push: WRITEs it awaits)."""

    request_id: str
    peer: Peer
    params: TransferParams | None
    local_ids: np.ndarray
    computed_tokens: int
    token: str
    transfers: dict[int, Transfer] = field(default_factory=dict)
    last_renew: float = 0.0
    expect_from: tuple[int, ...] = ()
    #: pull: the peer this request's READs were handed to the worker for (None: not yet)
    queued_for: Peer | None = None
    #: the local block ids of every KV-cache group (``local_ids``: all of them, nulls left out)
    groups: tuple[np.ndarray, ...] = ()
    #: pull: the READs (by source rank) that land in the staging buffer (kvbridge.nixl.staging)
    staged: dict[int, Staged] = field(default_factory=dict)
    #: pull: source ranks whose READ completed while the copy thread still copies it into place
    copying: set[int] = field(default_factory=set)
    #: pull: READs (by source rank) and their staging the worker posted, whose posting event
    #: poll() has not applied yet; a request given up meanwhile gives them up too
    unreported: tuple[dict[int, Transfer], dict[int, Staged]] | None = None

    @property
    def remote_id(self) -> str:
        """The id the prefill engine holds this request under (named in notifications)."""
        return (self.params.request_id if self.params is not None else "") or self.request_id


class DecodeMode:
    """How a decode rank receives requests; this base refuses every entry point."""

    name = "?"

    def __init__(self, engine: RankEngine) -> None:
        #: a DecodeEngine; the mode uses only its public surface (see RankEngine)
        self.engine = engine

    def load(self, request_id: str, params: TransferParams, local_ids: np.ndarray,
             computed_tokens: int, groups: tuple[np.ndarray, ...]) -> None:
        raise ValueError("load() is the pull-mode entry point; this engine is in push mode (use expect())")

    def prepare(self, params: TransferParams) -> None:
        raise ValueError("prepare() is for pull mode; in push mode the prefill side handshakes")

    def renew(self, params: TransferParams) -> None:
        self.prepare(params)

    def release(self, params: TransferParams) -> None:
        self.load("", params, np.zeros(0, dtype=np.int64), 0, ())

    def expect(self, request_id: str, prefill_engine_id: str, prefill_tp: int, token: str,
               local_ids: np.ndarray, prefill_block_size: int | None,
               prefill_head_order: str | None, prefill_kernel_blocks_per_block: int | None,
               groups: tuple[np.ndarray, ...]) -> None:
        raise ValueError("expect() is the push-mode entry point; this engine is in pull mode")

    def on_handshake(self, peer: Peer, err: str | None) -> None:
        """A handshake this rank started ended (caller thread)."""

    def on_event(self, event: object) -> None:
        """An event a worker job of this mode reported (``engine.report``; caller thread)."""

    def advance(self) -> None:
        """Check transfers and notifications (inside ``poll()``, the agent held)."""

    def keep_alive(self, now: float) -> None:
        """Renew what must not lapse (inside ``poll()``, after timeouts were applied)."""


class PrefillMode:
    """How a prefill rank hands out requests; this base refuses push()."""

    name = "?"

    def __init__(self, engine: RankEngine) -> None:
        #: a PrefillEngine; the mode uses only its public surface (see RankEngine)
        self.engine = engine

    def hold(self, request_id: str, block_ids: tuple[int, ...], token: str, now: float) -> None:
        """Keep a request's blocks until the decode side has them."""

    def push(self, request_id: str, block_ids: tuple[np.ndarray, ...], target: TransferParams) -> None:
        raise ValueError("push() needs an engine configured with mode='push'")

    def start(self, request_id: str, block_ids: tuple[np.ndarray, ...], target: TransferParams) -> None:
        raise ValueError("push_start() needs an engine configured with mode='push'")

    def write_layers(self, request_id: str, layers: tuple[int, ...]) -> None:
        raise ValueError("push_layers() needs an engine configured with mode='push'")

    def finish(self, request_id: str) -> None:
        raise ValueError("push_finish() needs an engine configured with mode='push'")

    def on_handshake(self, peer: Peer, err: str | None) -> None:
        """A handshake this rank started ended (caller thread)."""

    def on_event(self, event: object) -> None:
        """An event a worker job of this mode reported (``engine.report``; caller thread)."""

    def poll(self, now: float) -> list[Released]:
        """Advance this mode's requests; returns the ones whose blocks are free."""
        return []

    @property
    def held(self) -> int:
        """Requests this mode holds besides the engine's lease ledger."""
        return 0

