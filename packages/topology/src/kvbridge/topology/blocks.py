"""Block ids: logical vs kernel blocks, and block-size mismatch between engines."""

from __future__ import annotations

from dataclasses import dataclass

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


def logical_block_ids(kernel_ids: list[int] | tuple[int, ...], kernel_blocks_per_block: int) -> list[int]:
    """Logical ids of a run of kernel ids (each logical block's kernel ids must all be present)."""
    n = kernel_blocks_per_block
    out: list[int] = []
    for i in range(0, len(kernel_ids), n):
        group = list(kernel_ids[i : i + n])
        first = group[0]
        if first % n or group != list(range(first, first + n)):
            raise TopologyError(
                f"kernel block ids {group} do not form one logical block of {n} kernel blocks"
            )
        out.append(first // n)
    return out


@dataclass(frozen=True)
class UnitMatch:
    """Which unit (block slice) of which block receives which remote unit."""

    local_block: int
    local_unit: int
    remote_block: int
    remote_unit: int


def match_units(
    local_ids: list[int] | tuple[int, ...],
    remote_ids: list[int] | tuple[int, ...],
    local_block_size: int,
    remote_block_size: int,
) -> list[UnitMatch]:
    """Pair the transfer units of a request's local and remote blocks, in token order.

    The blocks of both sides hold the same tokens in order; a block of the larger
    size is ``ratio`` consecutive units. Units past the end of the shorter list
    (a partially filled last block) are left out.
    """
    ratio = block_size_ratio(local_block_size, remote_block_size)
    lu = ratio if local_block_size > remote_block_size else 1
    ru = ratio if remote_block_size > local_block_size else 1
    n = min(len(local_ids) * lu, len(remote_ids) * ru)
    return [
        UnitMatch(local_ids[g // lu], g % lu, remote_ids[g // ru], g % ru) for g in range(n)
    ]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed for ``num_tokens`` tokens."""
    if num_tokens < 0:
        raise TopologyError("token count cannot be negative")
    return -(-num_tokens // block_size)
