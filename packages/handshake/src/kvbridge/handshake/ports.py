"""Side-channel port assignment: several engines, replicas and ranks on one host.

Ports are a mixed-radix numbering above a base port::

    port = base_port + (engine_index * replicas_per_engine + replica) * ports_per_replica + rank

``ports_per_replica`` is 1 when one :class:`MetadataServer` serves all local
ranks of an engine (kvbridge's default) and the local rank count when every
rank runs its own server (vLLM's per-worker convention). As long as every
index stays below its bound, two different (engine, replica, rank) triples
never get the same port; out-of-bound indices and ports past 65535 raise.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PortAllocationError

MAX_PORT = 65535


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PortAllocationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class SideChannelPorts:
    """A host's side-channel port plan.

    ``engines`` (optional) bounds the engine index too, so that
    :meth:`all_ports` and the overflow check cover the whole host up front.
    """

    base_port: int
    replicas_per_engine: int = 1
    ports_per_replica: int = 1
    engines: int | None = None

    def __post_init__(self) -> None:
        _check_int("base_port", self.base_port, 1)
        if self.base_port > MAX_PORT:
            raise PortAllocationError(f"base_port {self.base_port} is past {MAX_PORT}")
        _check_int("replicas_per_engine", self.replicas_per_engine, 1)
        _check_int("ports_per_replica", self.ports_per_replica, 1)
        if self.engines is not None:
            _check_int("engines", self.engines, 1)
            last = self.base_port + self.engines * self.replicas_per_engine * self.ports_per_replica - 1
            if last > MAX_PORT:
                raise PortAllocationError(
                    f"{self.engines} engines x {self.replicas_per_engine} replicas x "
                    f"{self.ports_per_replica} ports from base port {self.base_port} need ports up "
                    f"to {last}, past {MAX_PORT}; lower the base port or the counts"
                )

    def port(self, *, engine_index: int = 0, replica: int = 0, rank: int = 0) -> int:
        """The port of (engine_index, replica, rank); raises PortAllocationError when out of range."""
        _check_int("engine_index", engine_index, 0)
        _check_int("replica", replica, 0)
        _check_int("rank", rank, 0)
        if self.engines is not None and engine_index >= self.engines:
            raise PortAllocationError(
                f"engine_index {engine_index} is not below engines={self.engines}"
            )
        if replica >= self.replicas_per_engine:
            raise PortAllocationError(
                f"replica {replica} is not below replicas_per_engine={self.replicas_per_engine}; "
                f"raise replicas_per_engine or another engine's ports would be reused"
            )
        if rank >= self.ports_per_replica:
            raise PortAllocationError(
                f"rank {rank} is not below ports_per_replica={self.ports_per_replica}; with one "
                f"server per rank set ports_per_replica to the local rank count"
            )
        slot = engine_index * self.replicas_per_engine + replica
        port = self.base_port + slot * self.ports_per_replica + rank
        if port > MAX_PORT:
            raise PortAllocationError(
                f"engine {engine_index} replica {replica} rank {rank} from base port "
                f"{self.base_port} lands on port {port}, past {MAX_PORT}; lower the base port"
            )
        return port

    def all_ports(self) -> list[int]:
        """Every port of the plan (needs ``engines``)."""
        if self.engines is None:
            raise PortAllocationError("all_ports() needs engines= to bound the engine index")
        n = self.engines * self.replicas_per_engine * self.ports_per_replica
        return list(range(self.base_port, self.base_port + n))


def side_channel_port(
    base_port: int,
    *,
    engine_index: int = 0,
    replica: int = 0,
    rank: int = 0,
    replicas_per_engine: int = 1,
    ports_per_replica: int = 1,
) -> int:
    """Shorthand for ``SideChannelPorts(...).port(...)``."""
    return SideChannelPorts(
        base_port, replicas_per_engine=replicas_per_engine, ports_per_replica=ports_per_replica
    ).port(engine_index=engine_index, replica=replica, rank=rank)
