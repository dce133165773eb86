"""The transfer engine's plain records: importable without NIXL, checked on construction."""

from __future__ import annotations

import pytest

from kvbridge.topology import TransferParams


def _params(**kw):
    args = dict(engine_id="p", host="127.0.0.1", port=5600, tp_size=2, block_ids=((1, 2),), token="t")
    return TransferParams(**(args | kw))


@pytest.mark.parametrize(("field", "value", "says"), [
    ("engine_id", "", "engine_id must be a non-empty string"),
    ("host", None, "host must be a string"),
    ("token", 5, "token must be a string"),
    ("port", 70000, "port must be an integer within 0..65535"),
    ("port", "5600", "port must be an integer"),
    ("tp_size", 0, "tp_size must be an integer >= 1"),
    ("tp_size", True, "tp_size must be an integer"),
    ("computed_tokens", -16, "computed_tokens must be an integer >= 0"),
])
def test_transfer_params_refuse_a_wrong_field_naming_it(field, value, says):
    with pytest.raises(ValueError, match=says):
        _params(**{field: value})


def test_transfer_params_are_frozen_and_hashable():
    p = _params()
    assert p == _params() and hash(p) == hash(_params())
    with pytest.raises(AttributeError):
        p.port = 1  # type: ignore[misc]


def test_block_ids_are_one_tuple_per_group_stored_as_tuples():
    assert _params(block_ids=[[1, 2], [0, 7]]).block_ids == ((1, 2), (0, 7))
    assert _params(block_ids=((),)).block_ids == ((),)
    p = _params(block_ids=((3, 4),))
    assert p.block_ids == ((3, 4),) and all(type(b) is int for b in p.block_ids[0])


@pytest.mark.parametrize(("ids", "says"), [
    ((1, 2, 3), r"flat list of block ids; pass one tuple per KV-cache group.*\(\(1, 2, 3\),\)"),
    ([], "names no KV-cache group"),
    (((1, -2),), "negative block id -2"),
    (((1, 2.5),), "holds 2.5, which is not a block id"),
    (((True,),), "holds True, which is not a block id"),
    (("12",), "group 0 must be a tuple of block ids"),
    (None, "one tuple of block ids per KV-cache group"),
])
def test_block_ids_of_the_wrong_shape_are_refused_saying_what_to_pass(ids, says):
    with pytest.raises(ValueError, match=says):
        _params(block_ids=ids)


def test_the_flat_list_advice_shows_a_valid_value():
    with pytest.raises(ValueError, match=r": \(\(7,\),\) for an engine"):
        _params(block_ids=[7])
    with pytest.raises(ValueError, match=r": \(\(1, 2, 3, \.\.\.\),\) for an engine"):
        _params(block_ids=[1, 2, 3, 4])
