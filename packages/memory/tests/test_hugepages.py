"""advise_huge_pages on real torch tensors: what it reports matches /proc/self/smaps."""

import pytest
import torch

from kvbridge.memory import advise_huge_pages, huge_page_bytes, huge_page_size
from kvbridge.memory.hugepages import _aligned

MIB = 1 << 20


def test_aligned_inside():
    page = 2 * MIB
    assert _aligned(0, 6 * MIB, page) == (0, 6 * MIB)
    assert _aligned(64, 6 * MIB, page) == (page, 4 * MIB)  # head and tail partial pages dropped
    assert _aligned(64, MIB, page) == (page, 0)  # shorter than a page: nothing
    assert _aligned(page - 1, page + 2, page) == (page, page)


def test_bad_range_is_a_clear_error():
    with pytest.raises(ValueError, match="address"):
        advise_huge_pages([(0, 4096)])
    with pytest.raises(ValueError, match="bytes"):
        advise_huge_pages([(4096, -1)])


def test_no_huge_pages_is_reported_not_raised():
    t = torch.zeros(4 * MIB, dtype=torch.uint8)
    res = advise_huge_pages([(t.data_ptr(), t.numel())], page_size=0)
    assert res.page_size == 0 and res.advised_bytes == 0 and res.skipped


@pytest.mark.skipif(huge_page_size() == 0, reason="no transparent huge pages on this host")
def test_collapse_moves_touched_tensor_onto_huge_pages():
    page = huge_page_size()
    t = torch.zeros(16 * MIB, dtype=torch.uint8)
    t.fill_(7)  # every page faulted in on small pages
    rng = [(t.data_ptr(), t.numel())]
    _, inside = _aligned(t.data_ptr(), t.numel(), page)
    res = advise_huge_pages(rng)
    assert res.page_size == page
    assert res.advised_bytes == inside
    if res.collapsed_bytes:  # MADV_COLLAPSE exists here (Linux 6.1+)
        assert res.collapsed_bytes == inside
        assert huge_page_bytes(rng) >= inside
    else:
        assert any("MADV_COLLAPSE" in e for e in res.errors)
    assert bool((t == 7).all())  # contents untouched
    # a range elsewhere does not count this tensor's huge pages
    other = torch.zeros(4 * MIB, dtype=torch.uint8)
    assert huge_page_bytes([(other.data_ptr(), 4096)]) <= 4096


def test_huge_page_bytes_of_nothing():
    assert huge_page_bytes([]) == 0
