"""The scheduler side of the connector: bookkeeping and the side-channel server.

vLLM runs one scheduler-side connector in the engine core. Its
:class:`SchedulerSide` keeps the per-request bookkeeping
(:class:`~kvbridge.vllm.steps.SchedulerState`: what to load, hold, release
and renew each step) and, on a prefill engine, serves every rank's handshake
metadata on the side channel, where decode engines fetch it.

Plain values in and out: this module imports nothing from vLLM (the facade,
:mod:`kvbridge.vllm.connector`, translates).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvbridge.handshake import MetadataServer, decode_metadata, send_push_offer
from kvbridge.vllm.config import ConnectorConfig, EngineRoles
from kvbridge.vllm.pushing import PushState
from kvbridge.vllm.steps import SchedulerState

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvbridge.vllm")


class SchedulerSide:
    """The engine core's half of the connector (see the module docstring).

    ``port`` is this engine's side-channel port (``config.port_for`` its
    data-parallel index); ``group_kinds`` and ``equal_tp_only`` describe a hybrid
    model (see :class:`~kvbridge.vllm.steps.SchedulerState`).
    """

    def __init__(self, *, engine_id: str, block_size: int, tp_size: int, config: ConnectorConfig,
                 port: int, roles: EngineRoles, group_kinds: Sequence[str] = (),
                 equal_tp_only: str | None = None) -> None:
        self.engine_id = engine_id
        self.host = config.side_channel_host
        self.port = port
        self._auth_key = config.auth_key
        self.server: MetadataServer | None = None
        self.state = SchedulerState(
            engine_id=engine_id, block_size=block_size, tp_size=tp_size,
            address=(self.host, port), producer=roles.producer, consumer=roles.consumer,
            heartbeat_s=config.heartbeat_seconds, mode=config.mode, group_kinds=group_kinds,
            equal_tp_only=equal_tp_only,
        )
        #: push mode (kvbridge.vllm.pushing); None in pull mode
        self.push: PushState | None = None
        if config.mode == "push":
            key, timeout = config.auth_key, config.handshake_timeout_seconds

            def send(host: str, port: int, **fields):
                return send_push_offer(host, port, timeout=timeout, auth_key=key, **fields)

            self.push = PushState(engine_id=engine_id, block_size=block_size, tp_size=tp_size,
                                  address=(self.host, port), layerwise=config.push_layerwise,
                                  wait_s=config.transfer_timeout_seconds, send_offer=send)

    def serve(self, payloads: Mapping[int, tuple]) -> None:
        """Serve every rank's metadata on the side channel (prefill side, pull mode).

        ``payloads`` maps each rank to its (compatibility hash, encoded metadata),
        as :meth:`kvbridge.vllm.worker.WorkerSide.handshake` returns them, optionally
        followed by the hash's fields (:meth:`~kvbridge.vllm.worker.WorkerSide.compat_info`),
        which a refused peer is shown. The ranks must agree on the hash and the
        incarnation; a second call replaces the metadata of the ranks it names.
        """
        if not payloads:
            return
        hashes = {p[0] for p in payloads.values()}
        if len(hashes) != 1:
            raise ValueError(f"the ranks of engine {self.engine_id!r} disagree on the "
                             f"compatibility hash ({sorted(hashes)}); they must run the same model")
        encoded = {rank: p[1] for rank, p in payloads.items()}
        info = next((dict(p[2]) for p in payloads.values() if len(p) > 2 and p[2]), None)
        # the server decodes and checks each rank's bytes once, refuses ranks of another
        # incarnation, and serves the bytes as they are
        if self.server is None:
            self.server = MetadataServer(encoded, compat_hash=hashes.pop(), host=self.host,
                                         port=self.port, auth_key=self._auth_key, compat_info=info,
                                         on_offer=None if self.push is None else self.push.on_offer)
        else:
            for rank, md in encoded.items():
                self.server.set_metadata(rank, md)
        self.state.set_incarnation(self.server.incarnation)
        if self.push is not None:
            md = decode_metadata(next(iter(encoded.values())))
            self.push.incarnation = self.server.incarnation
            self.push.accept_facts = dict(block_size=md.block_size,
                                          kernel_blocks_per_block=md.kernel_blocks_per_block,
                                          head_order=md.head_order)
        log.info("kvbridge: serving %d rank(s) of engine %s on %s:%d", len(encoded), self.engine_id,
                 self.server.host, self.server.port)

    def close(self) -> None:
        if self.push is not None:
            self.push.close()
        if self.server is not None:
            self.server.close()
            self.server = None
