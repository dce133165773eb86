"""Synthetic hybrid attention + Mamba-2 caches, shaped like vLLM's, with verifiable content.

As vLLM's hybrid KV-cache manager allocates them, every region is one tensor of
pages shared by one attention layer and one Mamba layer: a block id in the
attention group's list holds that layer's K and V (blocks-first ``[2, bytes]``, or one
packed K+V element of every head as vLLM >= 0.32 shapes it, at page offset 0), a block id in
the Mamba group's list holds the Mamba layer's conv state followed by its SSM
state. Pages are as large as the larger of the two; the other is padded. The
conv state is dimension-first (``[conv_dim, width]``: the x, B and C channels of
the rank are three contiguous byte ranges), so a rank's shard of a request's
state is x[its SSM heads] | B[its groups] | C[its groups] | SSM[its SSM heads]
and heterogeneous TP can read it piece by piece.

Layers are numbered as ``CacheGroup.layers`` counts them (positions in the
KV-cache list): attention layer ``i`` is entry ``2i``, Mamba layer ``i`` entry
``2i + 1``. Block ids are given per group: ``[attention ids, Mamba ids]``; the
state lives in the last non-null Mamba id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvbridge.topology import (
    CacheGroup,
    EngineSpec,
    GroupKind,
    HeadOrder,
    canonical_dtype,
    element_layout,
    head_range,
    mamba_state_bytes,
    mamba_state_layout,
)

from .synthetic_cache import SyntheticCache, flat_block_ids, logical_kv

PIECES = ("x", "B", "C", "ssm")


def hybrid_groups(spec: EngineSpec) -> tuple[CacheGroup, CacheGroup]:
    """The FULL attention group and the MAMBA group of a synthetic hybrid cache."""
    n = spec.num_layers
    return (CacheGroup(GroupKind.FULL, tuple(range(0, 2 * n, 2)), spec.block_size),
            CacheGroup(GroupKind.MAMBA, tuple(range(1, 2 * n, 2)), spec.block_size))


def with_hybrid_groups(spec: EngineSpec) -> EngineSpec:
    """``spec`` (a Mamba hybrid) with the groups of :func:`hybrid_groups`."""
    return replace(spec, groups=hybrid_groups(spec))


@dataclass(frozen=True)
class HybridContent:
    """A request's content: attention KV (:func:`logical_kv`) and, per Mamba layer, the whole
    (unsharded) state of every piece: ``state[name]`` is uint8 ``[layers, units, unit bytes]``."""

    kv: np.ndarray
    state: dict[str, np.ndarray]


def logical_content(spec: EngineSpec, seed: int, num_tokens: int) -> np.ndarray | HybridContent:
    """The content of a request of ``spec``: plain KV, or KV and Mamba state for hybrids."""
    kv = logical_kv(spec, seed, num_tokens)
    if spec.mamba is None:
        return kv
    rng = np.random.default_rng(seed + 7919)
    lay = mamba_state_layout(spec)
    state = {name: rng.integers(0, 256, size=(spec.num_layers, lay[name][0], lay[name][1]),
                                dtype=np.uint8) for name in PIECES}
    return HybridContent(kv, state)


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _attention_view(spec: EngineSpec, page: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The attention layer's view of the pages: blocks-first ``[blocks, 2, bytes]``, or packed
    as vLLM's CPU backend shapes it, ``[blocks, heads, tokens, 2 * head_dim]`` (HND) or
    ``[blocks, tokens, heads, 2 * head_dim]`` (NHD) in the cache's dtype (bytes otherwise)."""
    nb = page.shape[0]
    part = page[:, :nbytes]
    if not spec.is_packed:
        return part.view(nb, 2, nbytes // 2)
    dt = _TORCH_DTYPES.get(canonical_dtype(spec.dtype), torch.uint8)
    per = 2 * spec.head_dim * (1 if dt is not torch.uint8 else spec.dtype_size)
    heads, tokens = spec.heads_per_rank, spec.block_size
    inner = (heads, tokens) if spec.head_order is HeadOrder.HND else (tokens, heads)
    return part.view(dt).view(nb, *inner, per)


class HybridCache(SyntheticCache):
    """One rank's hybrid cache: page tensors shared by an attention and a Mamba layer."""

    @classmethod
    def allocate(cls, spec: EngineSpec, rank: int, num_blocks: int,
                 device: str | torch.device = "cpu") -> HybridCache:
        if spec.mamba is None or spec.kernel_blocks_per_block != 1:
            raise ValueError("a hybrid cache needs a Mamba spec and no kernel-block split")
        lay = element_layout(spec)
        page = spec.region_block_bytes
        state = mamba_state_bytes(spec)
        conv = mamba_state_layout(spec)["ssm"][2]
        regions, caches = [], []
        for _ in range(spec.num_layers):
            t = torch.zeros((num_blocks, page), dtype=torch.uint8, device=device)
            regions.append(t)
            caches.append(_attention_view(spec, t, lay.elements_per_block * lay.element_bytes))
            caches.append((t[:, :conv], t[:, conv:state]))
        return cls(spec, rank, num_blocks, regions, caches)

    # ----- Mamba state ---------------------------------------------------------
    def state_shard(self, content: HybridContent, layer: int) -> np.ndarray:
        """This rank's bytes of one Mamba layer's state page (x | B | C | SSM, unpadded)."""
        spec = self.spec
        parts = []
        for name in PIECES:
            units = content.state[name].shape[1]
            r = head_range(spec.tp_size, units, self.rank)
            parts.append(content.state[name][layer, r.start:r.stop].reshape(-1))
        return np.concatenate(parts)

    def _split(self, block_ids) -> tuple[list[int], list[int]]:
        ids = list(block_ids)
        if ids and not isinstance(ids[0], (int, np.integer)):
            attn, mamba = (list(g) for g in ids)
            return [int(b) for b in attn], [int(b) for b in mamba]
        return [int(b) for b in ids], []

    def fill(self, kv, block_ids, first_token: int = 0, null: int | None = 0) -> None:
        """Write this rank's shard of a request: attention into the first group's ids, the
        Mamba state into the last non-null id of the second group."""
        attn, mamba = self._split(block_ids)
        content = kv if isinstance(kv, HybridContent) else None
        super().fill(content.kv if content else kv, attn, first_token)
        page = self._state_page(mamba, null)
        if content is not None and page is not None:
            for layer, t in enumerate(self.regions):
                shard = self.state_shard(content, layer)
                t[page, :shard.size] = torch.from_numpy(shard).to(t.device)

    @staticmethod
    def _state_page(mamba: list[int], null: int | None) -> int | None:
        real = [b for b in mamba if b != null]
        return real[-1] if real else None

    def verify(self, kv, block_ids, first_token: int, num_tokens: int, layers=None,
               null: int | None = 0) -> int:
        """Mismatching bytes: attention blocks as :meth:`SyntheticCache.verify`, then every
        byte of this rank's Mamba state shard in the state page."""
        attn, mamba = self._split(block_ids)
        content = kv if isinstance(kv, HybridContent) else None
        bad = super().verify(content.kv if content else kv, attn, first_token, num_tokens, layers)
        page = self._state_page(mamba, null)
        if content is not None and page is not None:
            for layer, t in enumerate(self.regions):
                shard = self.state_shard(content, layer)
                bad += int(np.count_nonzero(t[page, :shard.size].cpu().numpy() != shard))
        return bad

    def clear(self, block_ids) -> None:
        super().clear(flat_block_ids(block_ids))
