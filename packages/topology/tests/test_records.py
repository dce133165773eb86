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
