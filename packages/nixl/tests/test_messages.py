import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.nixl.messages import (
    MAX_MESSAGE_BYTES,
    Kind,
    Notification,
    encode_notification,
    new_token,
    parse_notification,
)


def test_round_trip_with_separator_in_request_id():
    n = Notification(Kind.DONE, "req|with|bars ünï", 4, 3, new_token())
    assert parse_notification(encode_notification(n)) == n


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(list(Kind)), rid=st.text(min_size=1, max_size=200),
       tp=st.integers(1, 4096), data=st.data())
def test_round_trip_property(kind, rid, tp, data):
    rank = data.draw(st.integers(0, tp - 1))
    n = Notification(kind, rid, tp, rank, new_token())
    assert parse_notification(encode_notification(n)) == n


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_untrusted_bytes_never_raise(raw):
    out = parse_notification(raw)
    assert out is None or isinstance(out, Notification)


@pytest.mark.parametrize("raw", [
    b"", b"kvb1", b"kvb1|D|2|0|tok", b"kvb1|X|2|0|tok|r", b"kvb1|D|0|0|tok|r", b"kvb1|D|2|2|tok|r",
    b"kvb1|D|-1|0|tok|r", b"kvb1|D|2|0||r", b"kvb1|D|2|0|tok|", b"kvb2|D|2|0|tok|r",
    b"kvb1|D|2|0|tok|\xff\xfe", b"kvb1|D|2|0|" + b"t" * 65 + b"|r", b"kvb1|D|99999999|0|tok|r",
    b"kvb1|D|2|0|tok|" + b"r" * MAX_MESSAGE_BYTES, "kvb1|D|2|0|tok|r", None, 12,
])
def test_malformed_rejected(raw):
    assert parse_notification(raw) is None


def test_encode_rejects_unparseable_values():
    with pytest.raises(ValueError):
        encode_notification(Notification(Kind.DONE, "r", 2, 2, "tok"))
    with pytest.raises(ValueError):
        encode_notification(Notification(Kind.DONE, "r", 2, 0, "to|k"))
    with pytest.raises(ValueError):
        encode_notification(Notification(Kind.DONE, "", 2, 0, "tok"))
    with pytest.raises(ValueError):
        encode_notification(Notification(Kind.DONE, "r" * 2000, 2, 0, "tok"))
