"""Exceptions of kvbridge.topology."""


class TopologyError(ValueError):
    """A deployment shape or engine description that a transfer cannot serve.

    The message always says what to change.
    """
