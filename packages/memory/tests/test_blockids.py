import numpy as np
import pytest

from kvbridge.memory import BlockIdError, block_id_array


def test_valid_ids_come_back_as_int64() -> None:
    out = block_id_array([3, 0, 7], 8, "local")
    assert out.dtype == np.int64 and out.tolist() == [3, 0, 7]
    assert block_id_array(np.array([1, 2], dtype=np.int32), 3).dtype == np.int64
    assert block_id_array([], 4).size == 0


@pytest.mark.parametrize("ids, match", [
    ([0, 8, -1, 9], r"local block ids \[8, -1, 9\] are outside 0..7"),
    ([[1, 2]], "flat list of integers"),
    ([1.5], "flat list of integers"),
    (["a"], "flat list of integers"),
])
def test_bad_ids_are_refused_with_the_offenders(ids, match) -> None:
    with pytest.raises(BlockIdError, match=match):
        block_id_array(ids, 8, "local")
