"""Describe a vLLM engine's KV cache as a :class:`kvbridge.topology.EngineSpec`.

vLLM hands the connector one tensor per attention layer. This module reads
their shapes and strides (plain tuples, so it runs without vLLM or torch) and
the model facts from vLLM's configuration, and returns the engine description
kvbridge plans transfers with. Shapes it understands, per layer (``B`` kernel
blocks, ``H`` KV heads on this rank, ``N`` tokens per kernel block, ``D`` head
size, ``L`` MLA latent size):

* ``[B, H, N, 2D]`` — vLLM >= 0.32: K and V of each head packed together
  (layout ``packed``); head order HND when the heads dimension is outside the
  tokens dimension in memory, NHD otherwise;
* ``[2, B, ...]`` with ``[N, H, D]`` or ``[H, N, D]`` blocks — older vLLM
  FlashAttention-style caches (layout ``kv-first``);
* ``[B, 2, ...]`` — FlashInfer-style caches (layout ``blocks-first``);
* ``[B, N, L]`` — MLA latent caches (``kv-first``, MLA); vLLM 0.32 (CPU_MLA)
  allocates them with a head dimension of 1: ``[B, 1, N, L]``.

Anything else is refused with a message naming the shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvbridge.topology import (
    EngineSpec,
    HeadOrder,
    Layout,
    TopologyError,
    canonical_dtype,
    heads_per_rank,
)

__all__ = [
    "CacheShapeError",
    "LayerTensor",
    "ModelFacts",
    "dtype_name",
    "engine_spec_for",
    "layer_sort_key",
    "model_identity",
]

class CacheShapeError(ValueError):
    """A vLLM KV-cache tensor kvbridge cannot describe."""


@dataclass(frozen=True)
class ModelFacts:
    """What the connector reads from vLLM's configuration for one rank."""

    engine_id: str
    tp_size: int
    num_kv_heads: int  # total over all ranks (1 for MLA)
    head_dim: int  # head size (MLA: latent + rope size)
    block_size: int  # the scheduler's (logical) block size in tokens
    num_blocks: int  # logical blocks per layer (KVCacheConfig.num_blocks)
    use_mla: bool = False


@dataclass(frozen=True)
class LayerTensor:
    """One layer's cache tensor, as shape, element strides and dtype name."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch name ("float32") or kvbridge name ("fp32")


def dtype_name(torch_dtype: object) -> str:
    """kvbridge's name for a torch dtype or dtype name (``torch.bfloat16`` -> ``"bf16"``)."""
    try:
        return canonical_dtype(torch_dtype)
    except TopologyError as e:
        raise CacheShapeError(f"KV-cache dtype not supported: {e}") from None


def layer_sort_key(name: str) -> tuple:
    """Order layer names by their numeric parts (``layers.2`` before ``layers.10``)."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p)


def model_identity(architectures: Iterable[str] | None, *, hidden_size: int, num_layers: int,
                   num_heads: int, num_kv_heads: int, head_dim: int, vocab_size: int) -> str:
    """A model identity for the compatibility hash that does not depend on where the
    checkpoint lives (prefill and decode hosts often mount it at different paths)."""
    arch = ",".join(sorted(architectures or ())) or "unknown"
    return (f"{arch}|hidden={hidden_size}|layers={num_layers}|heads={num_heads}|"
            f"kv_heads={num_kv_heads}|head_dim={head_dim}|vocab={vocab_size}")


def _order(stride: Sequence[int], heads_dim: int, tokens_dim: int, heads: int, tokens: int) -> HeadOrder:
    if heads == 1 or tokens == 1:
        return HeadOrder.HND  # one head (or one token): both orders are the same bytes
    return HeadOrder.HND if stride[heads_dim] > stride[tokens_dim] else HeadOrder.NHD


def _describe(t: LayerTensor, facts: ModelFacts, h: int) -> tuple[Layout, HeadOrder, int, int]:
    """(layout, head order, kernel blocks, head_dim) of one layer tensor."""
    shape, stride = t.shape, t.stride
    d = facts.head_dim
    where = f"KV cache of layer {t.name!r} with shape {list(shape)}"
    if len(stride) != len(shape):
        raise CacheShapeError(f"{where}: {len(stride)} strides for {len(shape)} dimensions")
    if facts.use_mla:
        if len(shape) == 4 and shape[1] == 1:  # vLLM 0.32: [blocks, 1, tokens, latent]
            return Layout.KV_FIRST, HeadOrder.HND, shape[0], shape[3]
        if len(shape) != 3:
            raise CacheShapeError(f"{where}: an MLA cache must be [blocks, tokens, latent] or "
                                  "[blocks, 1, tokens, latent]")
        return Layout.KV_FIRST, HeadOrder.HND, shape[0], shape[2]
    if len(shape) == 4:
        b, heads, tokens, content = shape
        if heads != h or content != 2 * d:
            raise CacheShapeError(
                f"{where}: expected [blocks, {h} heads, tokens, {2 * d}] (K and V of {d} each "
                "packed per head)"
            )
        return Layout.PACKED, _order(stride, 1, 2, heads, tokens), b, d
    if len(shape) == 5 and shape[0] == 2 and shape[-1] == d:
        # [2, B, x, y, D]: x, y are (N, H) or (H, N)
        if shape[3] == h and shape[2] != h:
            return Layout.KV_FIRST, _order(stride, 3, 2, h, shape[2]), shape[1], d
        if shape[2] == h:
            return Layout.KV_FIRST, _order(stride, 2, 3, h, shape[3]), shape[1], d
    if len(shape) == 5 and shape[1] == 2 and shape[-1] == d:
        if shape[3] == h and shape[2] != h:
            return Layout.BLOCKS_FIRST, _order(stride, 3, 2, h, shape[2]), shape[0], d
        if shape[2] == h:
            return Layout.BLOCKS_FIRST, _order(stride, 2, 3, h, shape[3]), shape[0], d
    raise CacheShapeError(
        f"{where}: not a layout kvbridge knows ([blocks, heads, tokens, 2*head] packed, "
        f"[2, blocks, ...] kv-first, [blocks, 2, ...] blocks-first, or an MLA "
        f"[blocks, tokens, latent]) for {h} heads of {d} on this rank"
    )


def engine_spec_for(facts: ModelFacts, layers: Sequence[LayerTensor],
                    num_layers: int | None = None) -> EngineSpec:
    """The :class:`EngineSpec` of one rank's cache (``layers`` in any order).

    Every layer must have the same layout, head order, block count and dtype;
    the kernel block count must be a whole multiple of ``facts.num_blocks``.
    ``num_layers``: the attention tensors when several layers view one (vLLM's
    KV-cache groups share pages; default: one tensor per layer).
    """
    if not layers:
        raise CacheShapeError("no KV-cache tensors were registered")
    heads_total = 1 if facts.use_mla else facts.num_kv_heads
    try:
        h = heads_per_rank(facts.tp_size, heads_total)
    except TopologyError as exc:
        raise CacheShapeError(str(exc)) from exc
    seen = {}
    for t in layers:
        desc = _describe(t, facts, h) + (dtype_name(t.dtype),)
        seen.setdefault(desc, []).append(t.name)
    if len(seen) > 1:
        kinds = "; ".join(f"{names[:3]}: {d[0].value} {d[1].value}, {d[2]} blocks, {d[4]}"
                          for d, names in seen.items())
        raise CacheShapeError(
            f"the KV-cache layers differ ({kinds}); kvbridge transfers one uniform cache per "
            "engine (models with several KV-cache groups are not supported yet)"
        )
    (layout, order, kernel_blocks, head_dim, dtype), = seen
    if facts.num_blocks <= 0 or kernel_blocks % facts.num_blocks:
        raise CacheShapeError(
            f"the cache holds {kernel_blocks} blocks per layer, not a whole multiple of the "
            f"{facts.num_blocks} blocks the scheduler allocates"
        )
    n = kernel_blocks // facts.num_blocks
    try:
        return EngineSpec(
            engine_id=facts.engine_id, tp_size=facts.tp_size,
            num_kv_heads=heads_total, head_dim=head_dim, num_layers=num_layers or len(layers),
            block_size=facts.block_size, dtype=dtype, kernel_blocks_per_block=n,
            layout=layout, head_order=order, use_mla=facts.use_mla,
        )
    except TopologyError as exc:
        raise CacheShapeError(f"the KV cache cannot be described: {exc}") from exc
