"""The connector's two halves for the configured mode, chosen once.

:data:`MODES` names, per ``ConnectorConfig.mode``, how to build each half:
:func:`scheduler_half` builds the engine core's half (the mode's
:class:`~kvbridge.vllm.modes.SchedulerMode` and the :class:`SideChannel` it is
served on); :func:`worker_half` builds one TP rank's
:class:`~kvbridge.vllm.rank_engines.RankEngines`. This table is the only place
that looks at the mode.

Plain values in and out: this module imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.handshake import PushAccept, send_push_offer
from kvbridge.vllm.config import ConnectorConfig, EngineRoles
from kvbridge.vllm.modes import Orders, SchedulerMode
from kvbridge.vllm.pull.orders import PullOrders
from kvbridge.vllm.pull.scheduler import PullScheduler
from kvbridge.vllm.pull.worker import PullWorker
from kvbridge.vllm.push.orders import PushOrders
from kvbridge.vllm.push.scheduler import PushScheduler
from kvbridge.vllm.push.worker import PushWorker
from kvbridge.vllm.rank_engines import RankEngines
from kvbridge.vllm.side_channel import SideChannel

__all__ = ["MODES", "ModeHalves", "scheduler_half", "worker_half"]


@dataclass(frozen=True)
class EngineFacts:
    """What a scheduler half is built from (see :func:`scheduler_half`)."""

    engine_id: str
    block_size: int
    tp_size: int
    config: ConnectorConfig
    address: tuple[str, int]
    roles: EngineRoles
    group_kinds: tuple[str, ...]
    equal_tp_only: str | None
    drop_last_token: bool


def _pull_scheduler(f: EngineFacts) -> PullScheduler:
    return PullScheduler(engine_id=f.engine_id, block_size=f.block_size, tp_size=f.tp_size,
                         address=f.address, producer=f.roles.producer, consumer=f.roles.consumer,
                         heartbeat_s=f.config.heartbeat_seconds, group_kinds=f.group_kinds,
                         equal_tp_only=f.equal_tp_only, drop_last_token=f.drop_last_token)


def _push_scheduler(f: EngineFacts) -> PushScheduler:
    key, timeout = f.config.auth_key, f.config.handshake_timeout_seconds

    def send(host: str, port: int, **fields: Any) -> PushAccept:
        return send_push_offer(host, port, timeout=timeout, auth_key=key, **fields)

    return PushScheduler(engine_id=f.engine_id, block_size=f.block_size, tp_size=f.tp_size,
                         address=f.address, layerwise=f.config.push_layerwise,
                         wait_s=f.config.transfer_timeout_seconds, send_offer=send)


@dataclass(frozen=True)
class ModeHalves:
    """One mode's halves: how to build its scheduler half, its worker half's class, and its
    orders of a step with nothing to do (before vLLM bound any)."""

    scheduler: Callable[[EngineFacts], SchedulerMode]
    worker: type[RankEngines]
    no_orders: Orders


MODES: dict[str, ModeHalves] = {
    "pull": ModeHalves(_pull_scheduler, PullWorker, PullOrders()),
    "push": ModeHalves(_push_scheduler, PushWorker, PushOrders()),
}


def scheduler_half(*, engine_id: str, block_size: int, tp_size: int, config: ConnectorConfig,
                   port: int, roles: EngineRoles, group_kinds: Sequence[str] = (),
                   equal_tp_only: str | None = None, drop_last_token: bool = False
                   ) -> tuple[SchedulerMode, SideChannel]:
    """The engine core's half: the mode's bookkeeping and its side channel.

    ``port`` is this engine's side-channel port (``config.port_for`` its
    data-parallel index); ``group_kinds``, ``equal_tp_only`` and ``drop_last_token``
    describe a hybrid model (see :class:`~kvbridge.vllm.pull.scheduler.PullScheduler`).
    """
    facts = EngineFacts(engine_id, block_size, tp_size, config, (config.side_channel_host, port),
                        roles, tuple(group_kinds), equal_tp_only, drop_last_token)
    mode = MODES[config.mode].scheduler(facts)
    side = SideChannel(engine_id=engine_id, host=config.side_channel_host, port=port,
                       auth_key=config.auth_key, on_offer=mode.offer_handler)
    return mode, side


def worker_half(rank: int, roles: EngineRoles, config: ConnectorConfig, *,
                single_group: bool = True) -> RankEngines:
    """One TP rank's half for the configured mode."""
    return MODES[config.mode].worker(rank, roles, single_group=single_group)
