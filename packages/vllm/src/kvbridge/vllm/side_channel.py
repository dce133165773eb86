"""The prefill engine's side channel: every rank's handshake metadata, served by the scheduler.

vLLM runs one scheduler-side connector in the engine core; after the workers
registered their caches it hands it each rank's handshake payload
(:meth:`kvbridge.vllm.rank_engines.RankEngines.handshake`). :class:`SideChannel`
serves them with a :class:`kvbridge.handshake.MetadataServer`, where peers fetch
them (pull: decode engines) or send push offers to (push: decode schedulers
offer their blocks to the prefill engine's handler).

Plain values in and out: this module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvbridge.handshake import MetadataServer, OfferHandler, decode_metadata

__all__ = ["SideChannel"]

log = logging.getLogger("kvbridge.vllm")


class SideChannel:
    """One engine's metadata server, started by the first :meth:`serve`."""

    def __init__(self, *, engine_id: str, host: str, port: int, auth_key: str = "",
                 on_offer: OfferHandler | None = None) -> None:
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self._auth_key = auth_key
        self._on_offer = on_offer
        self.server: MetadataServer | None = None

    def serve(self, payloads: Mapping[int, tuple]) -> tuple[str, dict[str, Any]] | None:
        """Serve every rank's metadata; returns (this engine's incarnation, the cache facts
        a push accept names), or None when there is nothing to serve.

        ``payloads`` maps each rank to its (compatibility hash, encoded metadata),
        optionally followed by the hash's fields (which a refused peer is shown). The
        ranks must agree on the hash and the incarnation; a second call replaces the
        metadata of the ranks it names, or, when it names every served rank under one new
        incarnation (the cache registered again after vLLM's sleep mode), the server.
        """
        if not payloads:
            return None
        hashes = {p[0] for p in payloads.values()}
        if len(hashes) != 1:
            raise ValueError(f"the ranks of engine {self.engine_id!r} disagree on the "
                             f"compatibility hash ({sorted(hashes)}); they must run the same model")
        encoded = {rank: p[1] for rank, p in payloads.items()}
        info = next((dict(p[2]) for p in payloads.values() if len(p) > 2 and p[2]), None)
        incarnations = ({decode_metadata(md).incarnation for md in encoded.values()}
                        if self.server is not None and set(self.server.ranks) <= set(encoded)
                        else set())
        if self.server is not None and len(incarnations) == 1 \
                and self.server.incarnation not in incarnations:
            # every rank registered again under a new incarnation (vLLM sleep mode: woken up):
            # serve the new engine on the same port, so that peers handshake again
            log.info("kvbridge: engine %s is now incarnation %s; serving it anew",
                     self.engine_id, next(iter(incarnations)))
            self.server.close()
            self.server = None
        # the server decodes and checks each rank's bytes once, refuses ranks of another
        # incarnation, and serves the bytes as they are
        if self.server is None:
            self.server = MetadataServer(encoded, compat_hash=hashes.pop(), host=self.host,
                                         port=self.port, auth_key=self._auth_key, compat_info=info,
                                         on_offer=self._on_offer)
        else:
            for rank, md in encoded.items():
                self.server.set_metadata(rank, md)
        md = decode_metadata(next(iter(encoded.values())))
        log.info("kvbridge: serving %d rank(s) of engine %s on %s:%d", len(encoded), self.engine_id,
                 self.server.host, self.server.port)
        return self.server.incarnation, dict(block_size=md.block_size,
                                             kernel_blocks_per_block=md.kernel_blocks_per_block,
                                             head_order=md.head_order)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
