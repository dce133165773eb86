"""Block ids: logical vs kernel blocks, and block-size mismatch between engines."""

from __future__ import annotations

from .errors import TopologyError


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """How many smaller blocks make one larger block (1 when equal).

    Raises TopologyError when the larger size is not a multiple of the smaller.
    """
    big, small = max(local_block_size, remote_block_size), min(local_block_size, remote_block_size)
    if small <= 0 or big % small:
        raise TopologyError(
            f"block sizes {local_block_size} and {remote_block_size} do not divide; "
            "the larger block size must be a multiple of the smaller"
        )
    return big // small


def kernel_block_ids(logical_ids: list[int] | tuple[int, ...], kernel_blocks_per_block: int) -> list[int]:
    """Physical (kernel) block ids of logical blocks: id*n .. id*n+n-1 for each id, in order."""
    n = kernel_blocks_per_block
    if n <= 0:
        raise TopologyError("kernel_blocks_per_block must be positive")
    return [b * n + i for b in logical_ids for i in range(n)]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed for ``num_tokens`` tokens."""
    if num_tokens < 0:
        raise TopologyError("token count cannot be negative")
    return -(-num_tokens // block_size)
