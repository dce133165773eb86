"""The one check of block ids against a cache: every package that accepts block
ids from a caller or a peer turns them into an index array here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import MemoryLayoutError


class BlockIdError(MemoryLayoutError):
    """Block ids that are not a flat list of integers inside the cache (a ``ValueError``)."""


def block_id_array(ids: Sequence[int] | np.ndarray, num_blocks: int, what: str = "") -> np.ndarray:
    """``ids`` as a flat ``int64`` array, checked to lie in ``0 .. num_blocks - 1``.

    ``what`` names the ids in the error (``"local"``, ``"prefill"``, ...). Raises
    :class:`BlockIdError` naming up to five offending ids, or the wrong type.
    """
    label = f"{what} block ids" if what else "block ids"
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise BlockIdError(f"{label} must be a flat list of integers: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BlockIdError(
            f"{label} must be a flat list of integers, got shape {arr.shape} of {arr.dtype}"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= num_blocks)
    if bad.any():
        raise BlockIdError(
            f"{label} {arr[bad][:5].tolist()} are outside 0..{num_blocks - 1} "
            f"(the cache has {num_blocks} blocks)"
        )
    return arr
