"""Exceptions of kvbridge.memory."""

from kvbridge.topology import TopologyError


class MemoryLayoutError(TopologyError):
    """Cache tensors, geometry or block ids that cannot be described or transferred.

    A ``ValueError`` (through ``TopologyError``); the message says what to change.
    """
