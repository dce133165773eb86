"""advise_huge_pages on real torch tensors: what it reports matches /proc/self/smaps."""

import pytest
import torch

from kvbridge.memory import advise_huge_pages, huge_page_bytes, huge_page_size
from kvbridge.memory.hugepages import _aligned, _covering, anonymous_spans

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
    res = advise_huge_pages(rng, edges=False)
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


MAPS = """\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
7f0000a00000-7f0001000000 rw-p 00000000 00:00 0
7f0002000000-7f0002400000 r--p 00000000 08:01 1234 /usr/lib/libx.so
7f0003000000-7f0003200000 rw-p 00000000 00:00 0 [stack]
55d000000000-55d000400000 rw-p 00000000 00:00 0 [heap]
7f0004000000-7f0004400000 rw-s 00000000 00:05 99 /dev/zero (deleted)
"""


def test_anonymous_spans_merge_adjacent_and_skip_files_and_specials():
    assert anonymous_spans(MAPS) == [(0x7F0000000000, 0x7F0001000000), (0x55D000000000, 0x55D000400000)]
    assert anonymous_spans("") == []


def test_covering_takes_edge_pages_inside_anonymous_memory():
    page = 2 * MIB
    anon = [(0, 64 * MIB)]
    # a tensor 64 bytes past a page boundary: inside 3 pages, plus the head and tail pages
    assert _aligned(2 * MIB + 64, 4 * MIB, page) == (4 * MIB, 2 * MIB)
    assert _covering(2 * MIB + 64, 4 * MIB, page, anon) == (2 * MIB, 6 * MIB)
    # edge pages reaching outside the anonymous span stay out
    assert _covering(2 * MIB + 64, 4 * MIB, page, [(3 * MIB, 7 * MIB)]) == (4 * MIB, 2 * MIB)
    assert _covering(2 * MIB + 64, 4 * MIB, page, [(2 * MIB, 7 * MIB)]) == (2 * MIB, 4 * MIB)
    # aligned ranges are unchanged; a range inside one page is that page
    assert _covering(4 * MIB, 4 * MIB, page, anon) == (4 * MIB, 4 * MIB)
    assert _covering(4 * MIB + 64, 4096, page, anon) == (4 * MIB, 2 * MIB)


@pytest.mark.skipif(huge_page_size() == 0, reason="no transparent huge pages on this host")
def test_edges_put_a_whole_unaligned_tensor_on_huge_pages():
    page = huge_page_size()
    big = torch.zeros(64 * MIB, dtype=torch.uint8)  # anonymous memory around the tensor
    big.fill_(3)
    t = big[page // 2 + 64: page // 2 + 64 + 8 * MIB]  # starts and ends mid-page
    rng = [(t.data_ptr(), t.numel())]
    _, inside = _aligned(t.data_ptr(), t.numel(), page)
    res = advise_huge_pages(rng)
    assert res.advised_bytes == inside + 2 * page
    if res.collapsed_bytes:
        assert huge_page_bytes(rng) == t.numel()
    assert bool((big == 3).all())  # contents untouched, inside the range and around it
