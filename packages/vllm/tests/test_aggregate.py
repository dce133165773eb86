"""Scheduler-side merging of the workers' connector reports."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.vllm.aggregate import OutputAggregator, WorkerReport, merge_stats

R = WorkerReport.of


def test_finished_only_when_every_worker_reported() -> None:
    agg = OutputAggregator(2)
    m1 = agg.merge([R(0, sending={"a"}, recving={"x"}), R(1)])
    assert m1.finished_sending == frozenset() and m1.finished_recving == frozenset()
    assert agg.pending() == (frozenset({"a"}), frozenset({"x"}))
    m2 = agg.merge([R(0), R(1, sending={"a"}, recving={"x"})])
    assert m2.finished_sending == {"a"} and m2.finished_recving == {"x"}
    assert agg.pending() == (frozenset(), frozenset())


def test_same_worker_twice_does_not_count_twice() -> None:
    agg = OutputAggregator(2)
    agg.merge([R(0, recving={"x"})])
    assert agg.merge([R(0, recving={"x"})]).finished_recving == frozenset()
    assert agg.merge([R(1, recving={"x"})]).finished_recving == {"x"}


def test_two_reports_from_one_rank_in_a_step_is_an_error() -> None:
    with pytest.raises(ValueError, match="rank 0"):
        OutputAggregator(2).merge([R(0), R(0)])


def test_expected_count_change_at_run_time() -> None:
    agg = OutputAggregator(4)
    agg.merge([R(0, sending={"a"}), R(1, sending={"a"})])
    # A worker announces that only 2 ranks take part: "a" is now complete.
    m = agg.merge([R(0, expected_count=2)])
    assert m.finished_sending == {"a"} and m.expected_count == 2
    # Raising it again makes new requests wait for more workers.
    agg.set_expected_count(3)
    agg.merge([R(0, sending={"b"}), R(1, sending={"b"})])
    assert agg.merge([R(2, sending={"b"})]).finished_sending == {"b"}
    with pytest.raises(ValueError):
        agg.set_expected_count(0)
    with pytest.raises(ValueError):
        OutputAggregator(0)


def test_failed_receive_counts_as_done_and_is_reported_once_finished() -> None:
    agg = OutputAggregator(2)
    m1 = agg.merge([R(0, failed={"x"}), R(1)])
    assert m1.failed_recving == frozenset() and m1.finished_recving == frozenset()
    m2 = agg.merge([R(1, recving={"x"})])
    assert m2.finished_recving == {"x"} and m2.failed_recving == {"x"}
    assert agg.merge([R(0), R(1)]).failed_recving == frozenset()


def test_invalid_block_ids_union_and_stats_merge() -> None:
    agg = OutputAggregator(2)
    m = agg.merge([
        R(0, invalid={1, 2}, stats={"transfer_duration": [0.1], "num_failed": 1}),
        R(1, invalid={2, 9}, stats={"transfer_duration": [0.2, 0.3], "num_failed": 2, "x": [1]}),
    ])
    assert m.invalid_block_ids == {1, 2, 9}
    assert m.stats == {"transfer_duration": [0.1, 0.2, 0.3], "num_failed": 3, "x": [1]}
    assert agg.merge([R(0), R(1)]).stats is None


def test_late_duplicate_of_finished_request_is_ignored() -> None:
    agg = OutputAggregator(1)
    assert agg.merge([R(0, sending={"a"})]).finished_sending == {"a"}
    assert agg.merge([R(0, sending={"a"})]).finished_sending == frozenset()
    assert agg.pending() == (frozenset(), frozenset())


def test_forget_drops_a_request() -> None:
    agg = OutputAggregator(2)
    agg.merge([R(0, recving={"x"}, failed={"x"})])
    agg.forget("x")
    assert agg.pending() == (frozenset(), frozenset())
    assert agg.merge([R(1, recving={"x"})]).finished_recving == frozenset()


def test_merge_stats_rules() -> None:
    assert merge_stats(None, None) is None
    a = {"l": [1]}
    out = merge_stats(a, {"l": (2,), "n": 1.5})
    assert out == {"l": [1, 2], "n": 1.5}
    assert a == {"l": [1]}  # inputs untouched
    with pytest.raises(TypeError, match="'l'"):
        merge_stats({"l": [1]}, {"l": 3})


@settings(max_examples=60, deadline=None)
@given(
    n_workers=st.integers(1, 4),
    n_reqs=st.integers(1, 6),
    data=st.data(),
)
def test_each_request_finishes_exactly_once_when_last_worker_reports(
    n_workers: int, n_reqs: int, data: st.DataObject
) -> None:
    # Each (request, worker) report lands in a random step; some reports repeat.
    steps = 6
    when = {
        (r, w): data.draw(st.integers(0, steps - 1)) for r in range(n_reqs) for w in range(n_workers)
    }
    repeats = data.draw(st.sets(st.sampled_from(sorted(when)), max_size=3))
    agg = OutputAggregator(n_workers)
    finished_at: dict[int, int] = {}
    for s in range(steps):
        reports = []
        for w in range(n_workers):
            ids = {f"r{r}" for r in range(n_reqs) if when[(r, w)] == s}
            ids |= {f"r{r}" for (r, ww) in repeats if ww == w and when[(r, ww)] < s}
            reports.append(R(w, recving=ids))
        m = agg.merge(data.draw(st.permutations(reports)))
        for rid in m.finished_recving:
            r = int(rid[1:])
            assert r not in finished_at, "finished twice"
            finished_at[r] = s
    assert finished_at == {r: max(when[(r, w)] for w in range(n_workers)) for r in range(n_reqs)}
