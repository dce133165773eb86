"""Staged READs (kvbridge.nixl.staging): the planning math, the buffer's allocator, and
TP 2 -> 1 pulls over real NIXL agents that land in the staging buffer and are copied into place."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from test_engine import CFG, P, Pair, poll_round

from kvbridge.nixl import FailureKind
from kvbridge.nixl.staging import StagingArea, desc_addresses, runs, worth_staging
from kvbridge.tools.synthetic_cache import logical_kv

pytestmark = pytest.mark.timeout(120)

STAGED = replace(CFG, staging_mib=128)


def _rows(*rows):
    return np.array(rows, dtype=np.uint64)


def test_descriptor_addresses_follow_the_strided_rows():
    rows = _rows([1000, 16, 0, 32, 3], [5000, 16, 0, 16, 2])  # 3 pieces 32 apart, then 2 adjacent
    addr, length = desc_addresses(rows, np.array([0, 2, 3, 4]))
    assert addr.tolist() == [1000, 1064, 5000, 5016] and length.tolist() == [16] * 4
    with pytest.raises(ValueError, match="outside"):
        desc_addresses(rows, np.array([5]))


def test_runs_count_what_merging_adjacent_descriptors_leaves():
    ln = np.full(4, 16)
    assert runs(np.array([0, 16, 32, 48]), ln) == 1
    assert runs(np.array([0, 32, 64, 96]), ln) == 4
    assert runs(np.array([0, 16, 64, 80]), ln) == 2
    assert runs(np.zeros(0, np.int64), np.zeros(0, np.int64)) == 0


def test_only_pieces_scattered_here_and_adjacent_there_are_worth_staging():
    assert worth_staging(_rows([0, 16, 0, 32, 4]), _rows([0, 16, 0, 16, 4]))
    assert not worth_staging(_rows([0, 16, 0, 16, 4]), _rows([0, 16, 0, 16, 4]))  # both merge
    assert not worth_staging(_rows([0, 16, 0, 32, 4]), _rows([0, 16, 0, 32, 4]))  # neither does


def _area(nbytes=1 << 20, regions=None):
    region = np.zeros(64 << 10, dtype=np.uint8)
    return StagingArea(nbytes, regions or [(region.ctypes.data, region.nbytes)], huge_pages=False), region


def test_the_allocator_reuses_freed_bytes_and_says_when_it_is_full():
    area, region = _area(nbytes=48 << 10)
    base = region.ctypes.data
    rows_l = _rows([base, 1024, 0, 2048, 32])  # every other KiB of the region
    rows_r = _rows([1 << 40, 1024, 0, 1024, 32])  # back to back on the peer
    idx = np.arange(16, dtype=np.int32)
    a = area.plan(rows_l, rows_r, idx, idx)
    b = area.plan(rows_l, rows_r, idx, idx)
    assert (a.offset, b.offset) == (0, 16 << 10) and area.bytes_in_use == 32 << 10
    assert area.plan(rows_l, rows_r, np.arange(32, dtype=np.int32), np.arange(32, dtype=np.int32)) is None
    area.free(a)
    c = area.plan(rows_l, rows_r, idx, idx)
    assert c.offset == 0  # first fit: the freed bytes
    area.free(b)
    area.free(c)
    area.free(c)  # twice: nothing happens
    assert area.bytes_in_use == 0 and area._free == [(0, 48 << 10)]  # merged back into one range


def test_plans_that_would_not_pay_are_refused():
    area, region = _area()
    base = region.ctypes.data
    idx = np.arange(16, dtype=np.int32)
    same = _rows([base, 1024, 0, 1024, 32])
    assert area.plan(same, _rows([1 << 40, 1024, 0, 1024, 32]), idx, idx) is None  # merges already
    scattered = _rows([base, 1024, 0, 2048, 32])
    assert area.plan(scattered, _rows([1 << 40, 1024, 0, 4096, 32]), idx, idx) is None  # no gain
    odd = _rows([base + 512, 1024, 0, 2048, 31])  # pieces not aligned to their size
    assert area.plan(odd, _rows([1 << 40, 1024, 0, 1024, 31]), idx, idx) is None
    assert area.plan(scattered, _rows([1 << 40, 1024, 0, 1024, 32]), idx[:1], idx[:1]) is None  # too few
    assert area.bytes_in_use == 0


def test_scatter_puts_every_piece_in_place_in_any_order():
    area, region = _area()
    base = region.ctypes.data
    li = np.array([3, 0, 9, 5, 6, 7], dtype=np.int32)  # a strided run and scattered ones
    st = area.plan(_rows([base, 1024, 0, 2048, 32]), _rows([1 << 40, 1024, 0, 1024, 32]),
                   li, np.arange(6, dtype=np.int32))
    assert st is not None and st.n == 6
    payload = np.arange(6 * 1024, dtype=np.uint32).astype(np.uint8)
    area.buffer[st.offset:st.offset + payload.size] = payload
    area.scatter(st)
    for k, i in enumerate(li.tolist()):
        assert (region[i * 2048:i * 2048 + 1024] == payload[k * 1024:(k + 1) * 1024]).all()
    assert int(region.sum()) == int(payload.sum())  # nothing written anywhere else


def test_a_copy_is_claimed_once_and_a_handed_over_copy_runs_on_the_copy_thread():
    area, region = _area()
    base = region.ctypes.data
    rows_l, rows_r = _rows([base, 1024, 0, 2048, 32]), _rows([1 << 40, 1024, 0, 1024, 32])
    idx = np.arange(8, dtype=np.int32)
    st = area.plan(rows_l, rows_r, idx, idx)
    area.buffer[st.offset:st.offset + 8 * 1024] = 7
    area.copy_soon(st)
    assert st.claimed and st.future is not None
    st.future.result(timeout=10)
    assert not area.claim(st)  # the caller finds it taken
    area.copy_soon(st)  # a second hand-over does nothing
    assert all((region[i * 2048:i * 2048 + 1024] == 7).all() for i in range(8))
    other = area.plan(rows_l, rows_r, idx, idx)
    assert area.claim(other) and not area.claim(other)
    area.copy_soon(other)
    assert other.future is None  # claimed by the caller first: never handed over
    area.close()


def _pull(pair, rid, p_blocks, d_blocks, seed):
    pair.dec.load(rid, pair.hold(rid, p_blocks, seed=seed), (d_blocks,))
    return pair.run(lambda d, f, r: rid in d or f)


def test_a_heads_split_pull_is_staged_merged_and_every_byte_lands():
    pair = Pair(STAGED)
    try:
        done, failed, _ = _pull(pair, "a", [3, 4, 5, 6], [9, 10, 11, 12], seed=5)
        s = pair.dec.stats
        assert done == ["a"] and not failed
        assert s.staged_reads == 2  # one READ per prefill rank, both staged
        # 4 blocks x 2 layers x K, V per prefill rank: back to back there, merged per region
        assert (s.descriptors_posted, s.descriptors) == (32, 8)
        assert pair.dc.verify(logical_kv(P, 5, 64), [9, 10, 11, 12], 0, 64) == 0
        assert pair.dec.staging.bytes_in_use == 0
        # blocks out of order on the prefill side: too few merges to pay, read into place
        done, failed, _ = _pull(pair, "b", [7, 8, 2, 1], [4, 5, 6, 7], seed=6)
        assert done == ["b"] and not failed and s.staged_reads == 2
        assert pair.dc.verify(logical_kv(P, 6, 64), [4, 5, 6, 7], 0, 64) == 0
    finally:
        pair.close()


@pytest.mark.parametrize("background", [True, False], ids=["copy-thread", "poll"])
def test_both_copy_paths_put_every_byte_in_place(background):
    """The worker saw the READ complete (the copy thread copies) or only ``poll()`` did
    (``complete_in_background_s=0``: the caller copies)."""
    pair = Pair(replace(STAGED, complete_in_background_s=0.5 if background else 0.0))
    try:
        for k in range(3):
            blocks = [[9, 10, 11, 12], [4, 5, 6, 7], [12, 13, 14, 15]][k]
            done, failed, _ = _pull(pair, f"r{k}", [3, 4, 5, 6], blocks, seed=10 + k)
            assert done == [f"r{k}"] and not failed
            assert pair.dc.verify(logical_kv(P, 10 + k, 64), blocks, 0, 64) == 0
        assert pair.dec.stats.staged_reads == 6
        if not background:  # nobody but poll() saw the READs complete: no copy thread
            assert pair.dec.staging._copier is None
        assert pair.dec.staging.bytes_in_use == 0
    finally:
        pair.close()


def test_without_staging_every_piece_is_its_own_descriptor():
    """Negative control: the same pull with the default ``staging_mib=0`` makes no staging buffer."""
    pair = Pair(CFG)
    try:
        done, failed, _ = _pull(pair, "a", [3, 4, 5, 6], [9, 10, 11, 12], seed=5)
        s = pair.dec.stats
        assert done == ["a"] and not failed and pair.dec.staging is None
        assert (s.staged_reads, s.descriptors_posted, s.descriptors) == (0, 32, 32)
        assert pair.dc.verify(logical_kv(P, 5, 64), [9, 10, 11, 12], 0, 64) == 0
    finally:
        pair.close()


def test_the_copy_into_place_is_what_puts_the_bytes_there(monkeypatch):
    """Negative control: with the copy skipped, the staged bytes never reach the cache."""
    pair = Pair(STAGED)
    try:
        _pull(pair, "warm", [1], [1], seed=2)
        monkeypatch.setattr(pair.dec.staging, "scatter", lambda st: None)
        done, failed, _ = _pull(pair, "a", [3, 4, 5, 6], [9, 10, 11, 12], seed=5)
        assert done == ["a"] and pair.dec.stats.staged_reads == 2
        assert pair.dc.verify(logical_kv(P, 5, 64), [9, 10, 11, 12], 0, 64) > 0
    finally:
        pair.close()


def test_a_full_staging_buffer_reads_into_place():
    pair = Pair(replace(STAGED, staging_mib=1))
    try:
        _pull(pair, "warm", [1], [1], seed=2)
        area = pair.dec.staging
        hog = area._alloc(area.nbytes, 1)  # nothing left
        before = pair.dec.stats.staged_reads
        done, failed, _ = _pull(pair, "a", [3, 4, 5, 6], [9, 10, 11, 12], seed=5)
        assert done == ["a"] and not failed and pair.dec.stats.staged_reads == before
        assert pair.dc.verify(logical_kv(P, 5, 64), [9, 10, 11, 12], 0, 64) == 0
        assert hog == 0
    finally:
        pair.close()


def test_a_failed_copy_fails_the_request_and_frees_its_bytes(monkeypatch):
    pair = Pair(STAGED)
    try:
        _pull(pair, "warm", [1], [1], seed=2)

        def broken(st):
            raise OSError("copy broke")

        monkeypatch.setattr(pair.dec.staging, "scatter", broken)
        done, failed, _ = _pull(pair, "a", [3, 4, 5, 6], [9, 10, 11, 12], seed=5)
        assert done == [] and [(f.request_id, f.kind) for f in failed] == [("a", FailureKind.POST)]
        assert "copying staged blocks into place failed: copy broke" in failed[0].message
        assert pair.dec.stats.staged_reads == 2
        # the other source's READ may still be in flight when the first copy fails: its bytes
        # are freed once NIXL releases it, on a later poll(), and never before
        deadline = time.monotonic() + 10
        while pair.dec.staging.bytes_in_use and time.monotonic() < deadline:
            pair.dec.poll()
            time.sleep(0.005)
        assert pair.dec.staging.bytes_in_use == 0
    finally:
        pair.close()


def test_a_staged_read_that_times_out_keeps_its_bytes_until_it_ends(monkeypatch):
    """A timed-out READ may still land (NIXL cannot cancel it): its staging bytes are given
    back only once it has ended, so that no later READ's bytes are overwritten."""
    pair = Pair(replace(STAGED, transfer_timeout_s=0.5))
    try:
        _pull(pair, "warm", [1], [1], seed=2)
        monkeypatch.setattr(pair.dec.agent, "state", lambda x: "PROC")
        t0 = time.monotonic()
        done, failed, _ = _pull(pair, "a", [3, 4, 5, 6], [9, 10, 11, 12], seed=5)
        assert [(f.request_id, f.kind) for f in failed] == [("a", FailureKind.TIMEOUT)]
        assert pair.dec.stats.staged_reads == 2  # both READs were staged
        assert time.monotonic() - t0 < 5
        held = 4 * sum(t.shape[1] for t in pair.dc.regions)  # both READs: whole blocks
        for _ in range(10):  # still "in progress": their bytes stay held
            poll_round(pair.dec)
            assert pair.dec.staging.bytes_in_use == held
        monkeypatch.undo()  # the READs are seen complete: late, and their bytes come back
        end = time.monotonic() + 5
        while pair.dec.staging.bytes_in_use and time.monotonic() < end:
            poll_round(pair.dec)
        assert pair.dec.staging.bytes_in_use == 0
        assert pair.dec.stats.late_transfers == 2
    finally:
        pair.close()
