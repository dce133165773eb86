"""Block ids per KV-cache group: the one shape they take, and pairing rules (no NIXL needed here)."""

import numpy as np
import pytest

from kvbridge.nixl import EngineConfig
from kvbridge.nixl.groups import flat_ids, group_arrays


def test_one_group_is_one_tuple_of_ids():
    (g,) = group_arrays(((3, 4, 5),), 1, 10, "local")
    assert g.tolist() == [3, 4, 5] and g.dtype == np.int64
    (g,) = group_arrays([[3, 4]], 1, 10, "local")  # lists and arrays are groups too
    assert g.tolist() == [3, 4]
    (g,) = group_arrays((np.array([1, 2]),), 1, 10, "local")
    assert g.tolist() == [1, 2]


def test_per_group_ids():
    a, b = group_arrays([[1, 2], [0, 0, 7]], 2, 10, "prefill")
    assert a.tolist() == [1, 2] and b.tolist() == [0, 0, 7]
    assert flat_ids((a, b), 0).tolist() == [1, 2, 7]
    assert flat_ids((a, b), None).tolist() == [1, 2, 0, 0, 7]
    # no block in any group (release(), a full prefix hit): one empty tuple per group
    assert [x.size for x in group_arrays(((),) * 3, 3, 10, "local")] == [0, 0, 0]
    a, b = group_arrays(np.array([[1, 2], [3, 4]]), 2, 10, "local")
    assert b.tolist() == [3, 4]


def test_wrong_group_count_says_how_many():
    with pytest.raises(ValueError, match="expected 2 KV-cache group"):
        group_arrays([[1], [2], [3]], 2, 10, "local")
    with pytest.raises(ValueError, match="expected 3 KV-cache group"):
        group_arrays([], 3, 10, "local")
    with pytest.raises(ValueError, match="has 2 KV-cache groups"):
        group_arrays([1, 2], 2, 10, "local")
    with pytest.raises(ValueError, match=r"group 1\) block ids \[12\] are outside"):
        group_arrays([[1], [12]], 2, 10, "local")


@pytest.mark.parametrize("flat", [[3, 4], (3,), np.array([3, 4])])
def test_a_flat_list_is_refused_saying_what_to_pass(flat):
    with pytest.raises(ValueError, match=r"one flat list.*has 1 KV-cache group: pass one tuple .*\(ids,\)"):
        group_arrays(flat, 1, 10, "local")


def test_ids_that_are_not_integers_are_refused():
    with pytest.raises(ValueError, match="flat list of integers"):
        group_arrays(((1.5, 2.0),), 1, 10, "local")
    with pytest.raises(ValueError, match="one sequence of ids per KV-cache group"):
        group_arrays("12", 1, 10, "local")


def test_null_block_id_config():
    assert EngineConfig().null_block_id is None
    assert EngineConfig(null_block_id=0).null_block_id == 0
    with pytest.raises(ValueError, match="null_block_id"):
        EngineConfig(null_block_id=-1)
