"""Rearranging received blocks in place (torch ops on the cache memory).

A decode rank receives each local kernel block element as ``units``
consecutive transfer units, each in the *remote* head order with
``unit_tokens`` tokens: ``[units, heads, tokens, dim]`` (HND) or
``[units, tokens, heads, dim]`` (NHD). :func:`post_process` turns the listed
blocks into one element in the local order: ``[heads, units*tokens, dim]``
(HND) or ``[units*tokens, heads, dim]`` (NHD).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.topology import EngineSpec, HeadOrder, PostProcess

from .blockids import block_id_array
from .errors import MemoryLayoutError
from .kernel import kernel_spec
from .regions import CacheRegions


def post_process(
    regions: CacheRegions,
    block_ids: Sequence[int] | np.ndarray,
    post: PostProcess,
    spec: EngineSpec | None = None,
) -> None:
    """Rearrange the attention elements of local logical ``block_ids`` per ``post``.

    ``post`` comes from ``plan_transfer(kernel_spec(prefill), kernel_spec(decode))``;
    ``spec`` is the local engine (default ``regions.spec``). Does nothing when
    ``post.needed`` is false. Mamba pages are never touched. A packed cache is
    never rearranged: the order inside its head slices is backend-specific (and
    topology refuses every packed pair that would need it).
    """
    if not post.needed:
        return
    spec = spec or regions.spec
    if spec.is_packed:
        raise MemoryLayoutError(
            f"engine {spec.engine_id!r} uses the packed layout, whose head slices hold K and V in "
            "a backend-specific order, so received blocks cannot be rearranged "
            f"({post.source_order.value} -> {post.target_order.value}, {post.units_per_block} "
            "unit(s) per block); plan with plan_transfer(), which pairs packed caches only when "
            "head order and kernel block size are equal"
        )
    ksp = kernel_spec(spec)
    n = spec.kernel_blocks_per_block
    units, ut = post.units_per_block, post.unit_tokens
    if units * ut != ksp.block_size:
        raise MemoryLayoutError(
            f"post-processing for {units} units of {ut} tokens does not match local kernel blocks "
            f"of {ksp.block_size} tokens; plan with kernel_spec() of both engines"
        )
    heads = ksp.heads_per_rank
    row = spec.head_dim * spec.dtype_size
    elem = heads * ksp.block_size * row
    ids = block_id_array(block_ids, regions.num_blocks, "local")
    if len(ids) == 0:
        return
    kids = (ids[:, None] * n + np.arange(n)).ravel()
    for i, reg in enumerate(regions.regions):
        if reg.element_bytes != elem:
            raise MemoryLayoutError(
                f"region {i} elements are {reg.element_bytes} bytes, expected {elem} for {heads} "
                f"heads x {ksp.block_size} tokens; spec does not match the cache"
            )
        kstride = reg.block_stride // n
        view = regions.byte_view(i).reshape(regions.num_blocks * n, kstride)
        idx = torch.as_tensor(kids, device=view.device)
        for off in reg.element_offsets:
            part = view[:, off:off + elem]
            blocks = part.index_select(0, idx)
            b = blocks.shape[0]
            if post.source_order is HeadOrder.HND:
                src = blocks.view(b, units, heads, ut, row)  # [b, u, h, t, d]
            else:
                src = blocks.view(b, units, ut, heads, row).permute(0, 1, 3, 2, 4)
            # src is [b, units, heads, tokens, dim]
            if post.target_order is HeadOrder.HND:
                dst = src.permute(0, 2, 1, 3, 4)  # [b, h, u, t, d] = [b, h, u*t, d]
            else:
                dst = src.permute(0, 1, 3, 2, 4)  # [b, u, t, h, d] = [b, u*t, h, d]
            part.index_copy_(0, idx, dst.reshape(b, elem))
