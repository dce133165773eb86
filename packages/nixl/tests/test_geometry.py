import numpy as np
import pytest

from kvbridge.nixl.agent import expand_strided
from kvbridge.nixl.geometry import (
    CacheGeometry,
    Side,
    check_block_ids,
    request_indices,
    strided_descs,
    unit_pairs,
)


def geom(nb=6, bb=64, offs=(0, 32), eb=32, bases=(1000, 9000)):
    return CacheGeometry(bases, nb, bb, offs, eb)


def test_strided_rows_expand_to_region_major_block_minor():
    g = geom()
    side = Side(g, units_per_block=2, unit_bytes=16)
    pieces = [(0, 8), (8, 8)]
    flat = expand_strided(strided_descs(side, pieces))
    # naive reference: one descriptor per (role, unit, piece, block)
    ref = []
    for base in (1000, 9000):
        for eo in (0, 32):
            for u in range(2):
                for off, ln in pieces:
                    for b in range(6):
                        ref.append((base + eo + b * 64 + u * 16 + off, ln, 0))
    assert flat.tolist() == [list(r) for r in ref]


def test_request_indices_select_the_matching_descriptors():
    g = geom()
    side = Side(g, 2, 16)
    flat = expand_strided(strided_descs(side, [(0, 16)]))
    blocks = np.array([4, 1])
    units = np.array([1, 0])
    idx = request_indices(blocks, units, g.roles, 2, 1, g.num_blocks)
    assert idx.dtype == np.int32
    got = flat[idx, 0].tolist()
    want = [base + eo + b * 64 + u * 16 for base in (1000, 9000) for eo in (0, 32)
            for b, u in ((4, 1), (1, 0))]
    assert got == want


def test_unit_pairs_block_size_mismatch_and_prefix_skip():
    # local blocks hold 2 units, remote blocks 1 unit
    lb, lu, rb, ru = unit_pairs([7, 3], [10, 11, 12, 13], 2, 1)
    assert lb.tolist() == [7, 7, 3, 3] and lu.tolist() == [0, 1, 0, 1]
    assert rb.tolist() == [10, 11, 12, 13] and ru.tolist() == [0, 0, 0, 0]
    # remote bigger; prefix hit of one unit; local has more room than remote has units
    lb, lu, rb, ru = unit_pairs([1, 2, 3, 4], [20, 21], 1, 2, skip_remote_units=1)
    assert lb.tolist() == [1, 2, 3] and rb.tolist() == [20, 21, 21] and ru.tolist() == [1, 0, 1]
    lb, *_ = unit_pairs([], [1, 2], 1, 1)
    assert lb.size == 0


def test_registration_and_validation():
    g = geom()
    reg = g.registration()
    assert reg.tolist() == [[1000, 384, 0], [9000, 384, 0]]
    with pytest.raises(ValueError, match="do not fit"):
        CacheGeometry((0,), 1, 16, (0, 12), 8)
    with pytest.raises(ValueError, match="outside"):
        check_block_ids(np.array([0, 6]), 6, "local")
