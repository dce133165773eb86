"""Block ids per KV-cache group: normalization and pairing rules (no NIXL needed here)."""

import numpy as np
import pytest

from kvbridge.nixl import EngineConfig
from kvbridge.nixl.groups import as_params_ids, flat_ids, split_block_ids


def test_flat_ids_are_one_group():
    (g,) = split_block_ids([3, 4, 5], 1, 10, "local")
    assert g.tolist() == [3, 4, 5] and g.dtype == np.int64
    (g,) = split_block_ids([[3, 4]], 1, 10, "local")  # per-group form of one group
    assert g.tolist() == [3, 4]
    assert as_params_ids((np.array([1, 2]),)) == (1, 2)


def test_per_group_ids():
    a, b = split_block_ids([[1, 2], [0, 0, 7]], 2, 10, "prefill")
    assert a.tolist() == [1, 2] and b.tolist() == [0, 0, 7]
    assert as_params_ids((a, b)) == ((1, 2), (0, 0, 7))
    assert flat_ids((a, b), 0).tolist() == [1, 2, 7]
    assert flat_ids((a, b), None).tolist() == [1, 2, 0, 0, 7]
    # an empty list: no block in any group (release(), a full prefix hit)
    assert [x.size for x in split_block_ids([], 3, 10, "local")] == [0, 0, 0]
    a, b = split_block_ids(np.array([[1, 2], [3, 4]]), 2, 10, "local")
    assert b.tolist() == [3, 4]


def test_wrong_group_count_says_how_many():
    with pytest.raises(ValueError, match="expected 2 KV-cache group"):
        split_block_ids([[1], [2], [3]], 2, 10, "local")
    with pytest.raises(ValueError, match="has 2 KV-cache groups"):
        split_block_ids([1, 2], 2, 10, "local")
    with pytest.raises(ValueError, match=r"group 1\) block ids \[12\] are outside"):
        split_block_ids([[1], [12]], 2, 10, "local")


def test_null_block_id_config():
    assert EngineConfig().null_block_id is None
    assert EngineConfig(null_block_id=0).null_block_id == 0
    with pytest.raises(ValueError, match="null_block_id"):
        EngineConfig(null_block_id=-1)
