"""An engine described at kernel (physical) block granularity.

An attention kernel may split each logical block into ``kernel_blocks_per_block``
physical blocks; descriptors address physical blocks, so read plans are made
on the specs :func:`kernel_spec` returns.
"""

from __future__ import annotations

from dataclasses import replace

from kvbridge.topology import EngineSpec

from .errors import MemoryLayoutError


def kernel_spec(spec: EngineSpec) -> EngineSpec:
    """The same engine described at kernel-block granularity.

    Attention descriptors address physical (kernel) blocks, so read plans must
    be made on these specs: ``plan_rank(kernel_spec(local), kernel_spec(remote), r)``.
    Returns ``spec`` itself when a logical block is one kernel block.
    """
    n = spec.kernel_blocks_per_block
    if n == 1:
        return spec
    block_bytes = None
    if spec.block_bytes is not None:
        if spec.block_bytes % n:
            raise MemoryLayoutError(
                f"engine {spec.engine_id!r}: block_bytes {spec.block_bytes} is not divisible by "
                f"kernel_blocks_per_block {n}; a logical block must be whole kernel blocks"
            )
        block_bytes = spec.block_bytes // n
    return replace(spec, block_size=spec.block_size // n, kernel_blocks_per_block=1,
                   block_bytes=block_bytes)
