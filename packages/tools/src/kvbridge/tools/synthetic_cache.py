"""Synthetic KV caches in host memory, filled with verifiable content.

Used by ``kvbridge demo``, ``kvbridge bench`` and the multi-process tests. A
request's KV content is a deterministic function of a seed: random bytes
``G[layer, kind, head, token, byte]`` (``byte`` spans one head's ``head_dim``
values). A rank's block holds its heads' slice of ``G`` in the engine's layout
and head order, so every received byte can be checked against the expected
shard. Packed caches (K and V of a head together, as vLLM >= 0.32 stores them)
are laid out like vLLM's CPU backend: per head, the block's K rows then its V
rows (HND), or per token each head's K then V (NHD).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.memory import CacheRegions, regions_from_kv_caches
from kvbridge.topology import KIND_KV, EngineSpec, HeadOrder, element_layout, head_range


def flat_block_ids(block_ids) -> list[int]:
    """Block ids given flat or per KV-cache group, as one flat list."""
    out: list[int] = []
    for b in block_ids:
        if isinstance(b, (int, np.integer)):
            out.append(int(b))
        else:
            out.extend(int(x) for x in b)
    return out


def logical_kv(spec: EngineSpec, seed: int, num_tokens: int) -> np.ndarray:
    """The request's whole KV content: uint8 [layers, kinds, heads, tokens, head bytes]."""
    kinds = 1 if spec.use_mla else 2
    heads = spec.kv_heads_for_placement
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(spec.num_layers, kinds, heads, num_tokens,
                                      spec.head_dim * spec.dtype_size), dtype=np.uint8)


@dataclass
class SyntheticCache:
    """One rank's cache as an engine allocates it (``kv_caches``: one uint8 tensor per layer,
    or one for all layers when cross-layer), and a ``[num_blocks, block_bytes]`` view per
    region (``regions``, in :func:`~kvbridge.topology.element_layout` order) for filling and
    checking."""

    spec: EngineSpec
    rank: int
    num_blocks: int
    regions: list[torch.Tensor]
    kv_caches: list[torch.Tensor]

    @classmethod
    def allocate(cls, spec: EngineSpec, rank: int, num_blocks: int,
                 device: str | torch.device = "cpu") -> SyntheticCache:
        """Zeroed caches for ``num_blocks`` blocks on ``device`` (host memory, or a CUDA
        device such as ``"cuda:0"``)."""
        lay = element_layout(spec)
        nb, rb = num_blocks, lay.region_block_bytes
        zeros = functools.partial(torch.zeros, dtype=torch.uint8, device=device)
        if spec.cross_layer:
            caches = [zeros((nb, rb))]
            regions = list(caches)
        elif lay.separate_kv_regions:  # kv-first: [2, blocks, ...] per layer
            caches = [zeros((2, nb, rb)) for _ in range(spec.num_layers)]
            regions = [t[k] for t in caches for k in range(2)]
        else:  # blocks-first [blocks, 2, ...] or MLA [blocks, ...]
            caches = [zeros((nb, lay.elements_per_block, lay.element_bytes))
                      for _ in range(spec.num_layers)]
            regions = [t.view(nb, rb) for t in caches]
            if spec.use_mla:
                caches = regions
        return cls(spec, rank, num_blocks, regions, caches)

    def cache_regions(self, spec: EngineSpec | None = None) -> CacheRegions:
        """The regions an engine registers (``spec``: the engine's description, by default
        this cache's; a kernel-split engine may describe a cache allocated for its kernel blocks)."""
        return regions_from_kv_caches(self.kv_caches, spec or self.spec)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.regions)

    def _arrange(self, parts: list[np.ndarray]) -> np.ndarray:
        """One element from per-kind ``[heads, tokens, x]`` arrays, in this engine's order."""
        if len(parts) == 1:  # a K, V or MLA element
            out = parts[0]
            if self.spec.head_order is HeadOrder.NHD:
                out = out.transpose(1, 0, 2)
        elif self.spec.head_order is HeadOrder.HND:  # packed: per head, K rows then V rows
            out = np.concatenate(parts, axis=1)
        else:  # packed NHD: per token and head, K then V
            out = np.concatenate(parts, axis=2).transpose(1, 0, 2)
        return np.ascontiguousarray(out).reshape(-1)

    @staticmethod
    def _kinds(kind: int) -> tuple[int, ...]:
        return (0, 1) if kind == KIND_KV else (kind,)

    def _element(self, kv: np.ndarray, layer: int, kind: int, tok0: int, ntok: int) -> np.ndarray:
        """Bytes of one element (block of ``block_size`` tokens from ``tok0``) for this rank."""
        spec = self.spec
        heads = head_range(spec.tp_size, spec.kv_heads_for_placement, self.rank)
        hb = spec.head_dim * spec.dtype_size
        avail = max(0, min(ntok, kv.shape[3] - tok0))
        parts = []
        for k in self._kinds(kind):
            part = np.zeros((len(heads), spec.block_size, hb), dtype=np.uint8)
            part[:, :avail] = kv[layer, k, heads.start:heads.stop, tok0:tok0 + avail]
            parts.append(part)
        return self._arrange(parts)

    def _token_of_byte(self, kind: int) -> np.ndarray:
        """For each byte of an element of ``kind``: the token (within the block) it belongs to."""
        spec = self.spec
        hpr = len(head_range(spec.tp_size, spec.kv_heads_for_placement, self.rank))
        tok = np.broadcast_to(np.arange(spec.block_size)[None, :, None],
                              (hpr, spec.block_size, spec.head_dim * spec.dtype_size))
        return self._arrange([tok] * len(self._kinds(kind)))

    def _blocks_view(self) -> list[tuple[torch.Tensor, int, int]]:
        """(region tensor, element offset, role) for every role."""
        lay = element_layout(self.spec)
        out = []
        for i, t in enumerate(self.regions):
            for e, off in enumerate(lay.element_offsets):
                out.append((t, off, i * lay.elements_per_block + e))
        return out

    def fill(self, kv: np.ndarray, block_ids: list[int], first_token: int = 0) -> None:
        """Write this rank's shard of ``kv`` into ``block_ids`` (tokens from ``first_token``)."""
        lay = element_layout(self.spec)
        bs = self.spec.block_size
        for t, off, role in self._blocks_view():
            layer, kind = lay.element_roles[role]
            for j, b in enumerate(block_ids):
                el = self._element(kv, layer, kind, first_token + j * bs, bs)
                t[b, off:off + el.size] = torch.from_numpy(el).to(t.device)

    def expected(self, kv: np.ndarray, block_ids: list[int], first_token: int,
                 num_tokens: int) -> dict[tuple[int, int], np.ndarray]:
        """(role, block) -> expected element bytes, for tokens [first_token, num_tokens)."""
        lay = element_layout(self.spec)
        bs = self.spec.block_size
        out = {}
        for _, _, role in self._blocks_view():
            layer, kind = lay.element_roles[role]
            for j, b in enumerate(block_ids):
                tok0 = first_token + j * bs
                out[(role, b)] = self._element(kv, layer, kind, tok0, min(bs, num_tokens - tok0))
        return out

    def verify(self, kv: np.ndarray, block_ids: list[int], first_token: int, num_tokens: int,
               layers: Iterable[int] | None = None) -> int:
        """Number of mismatching bytes in ``block_ids`` against the expected shard of ``kv``.

        Only tokens below ``num_tokens`` are compared (a partial last block's
        tail is undefined); only the elements of ``layers`` when given.
        """
        bs = self.spec.block_size
        lay = element_layout(self.spec)
        bad = 0
        exp = self.expected(kv, block_ids, first_token, num_tokens)
        only = None if layers is None else set(layers)
        for t, off, role in self._blocks_view():
            if only is not None and lay.element_roles[role][0] not in only:
                continue
            tok = None
            for j, b in enumerate(block_ids):
                e = exp[(role, b)]
                got = t[b, off:off + e.size].cpu().numpy()
                valid = min(bs, num_tokens - (first_token + j * bs))
                if valid < bs:
                    if tok is None:
                        tok = self._token_of_byte(lay.element_roles[role][1])
                    keep = tok < valid
                    bad += int(np.count_nonzero(got[keep] != e[keep]))
                else:
                    bad += int(np.count_nonzero(got != e))
        return bad

    def clear(self, block_ids) -> None:
        """Zero whole blocks (ids flat or per group)."""
        idx = torch.as_tensor(flat_block_ids(block_ids), dtype=torch.long)
        for t in self.regions:
            t[idx] = 0

