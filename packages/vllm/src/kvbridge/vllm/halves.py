"""The connector's two halves for the configured mode, chosen once.

:func:`scheduler_half` builds the engine core's half (the mode's
:class:`~kvbridge.vllm.modes.SchedulerMode` and the :class:`SideChannel` it is
served on); :func:`worker_half` builds one TP rank's
:class:`~kvbridge.vllm.rank_engines.RankEngines`. These are the only places that
look at ``ConnectorConfig.mode``.

Plain values in and out: this module imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbridge.handshake import PushAccept, send_push_offer
from kvbridge.vllm.config import ConnectorConfig, EngineRoles
from kvbridge.vllm.modes import SchedulerMode
from kvbridge.vllm.pull.orders import PullOrders
from kvbridge.vllm.pull.scheduler import PullScheduler
from kvbridge.vllm.pull.worker import PullWorker
from kvbridge.vllm.push.orders import PushOrders
from kvbridge.vllm.push.scheduler import PushScheduler
from kvbridge.vllm.push.worker import PushWorker
from kvbridge.vllm.rank_engines import RankEngines
from kvbridge.vllm.side_channel import SideChannel

__all__ = ["empty_orders", "scheduler_half", "worker_half"]


def scheduler_half(*, engine_id: str, block_size: int, tp_size: int, config: ConnectorConfig,
                   port: int, roles: EngineRoles, group_kinds: Sequence[str] = (),
                   equal_tp_only: str | None = None, drop_last_token: bool = False
                   ) -> tuple[SchedulerMode, SideChannel]:
    """The engine core's half: the mode's bookkeeping and its side channel.

    ``port`` is this engine's side-channel port (``config.port_for`` its
    data-parallel index); ``group_kinds``, ``equal_tp_only`` and ``drop_last_token``
    describe a hybrid model (see :class:`~kvbridge.vllm.pull.scheduler.PullScheduler`).
    """
    address = (config.side_channel_host, port)
    mode: SchedulerMode
    if config.mode == "push":
        key, timeout = config.auth_key, config.handshake_timeout_seconds

        def send(host: str, port: int, **fields: Any) -> PushAccept:
            return send_push_offer(host, port, timeout=timeout, auth_key=key, **fields)

        mode = PushScheduler(engine_id=engine_id, block_size=block_size, tp_size=tp_size,
                             address=address, layerwise=config.push_layerwise,
                             wait_s=config.transfer_timeout_seconds, send_offer=send)
    else:
        mode = PullScheduler(engine_id=engine_id, block_size=block_size, tp_size=tp_size,
                             address=address, producer=roles.producer, consumer=roles.consumer,
                             heartbeat_s=config.heartbeat_seconds, group_kinds=group_kinds,
                             equal_tp_only=equal_tp_only, drop_last_token=drop_last_token)
    side = SideChannel(engine_id=engine_id, host=config.side_channel_host, port=port,
                       auth_key=config.auth_key, on_offer=mode.offer_handler)
    return mode, side


def worker_half(rank: int, roles: EngineRoles, config: ConnectorConfig, *,
                single_group: bool = True) -> RankEngines:
    """One TP rank's half for the configured mode."""
    cls = PushWorker if config.mode == "push" else PullWorker
    return cls(rank, roles, single_group=single_group)


def empty_orders(config: ConnectorConfig) -> PullOrders | PushOrders:
    """The configured mode's orders of a step with nothing to do."""
    return PushOrders() if config.mode == "push" else PullOrders()
