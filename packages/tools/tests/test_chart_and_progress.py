"""The scale chart (matplotlib) and the progress bars (tqdm): what they draw and where."""

from __future__ import annotations

import io
import time

import pytest

from kvbridge.tools.chart import Panel, figure, save
from kvbridge.tools.progress_bars import DELAY_S, progress, ticker

PANELS = [
    Panel("cost", "blocks per request", "ms (log)",
          {"transfer": [(10, 2.0), (1, 0.5), (100, 9.0)], "prep": [(1, 0.01), (10, 0.05), (100, 0.4)]}),
    Panel("in flight", "requests in flight", "ms (log)", {"batch": [(1, 1.0), (4, 3.0)]}),
]


def test_figure_has_a_log_log_panel_per_panel_with_every_point():
    fig = figure(PANELS, note="measured in the same run")
    assert len(fig.axes) == 2
    first, second = fig.axes
    assert (first.get_title(), first.get_xlabel(), first.get_ylabel()) == (
        "cost", "blocks per request", "ms (log)")
    assert first.get_xscale() == first.get_yscale() == "log" == second.get_xscale()
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in first.get_lines()}
    assert lines == {"transfer": ([1, 10, 100], [0.5, 2.0, 9.0]),  # sorted by x
                     "prep": ([1, 10, 100], [0.01, 0.05, 0.4])}
    assert all(ln.get_marker() == "o" for ln in first.get_lines())
    assert [t.get_text() for t in first.get_legend().get_texts()] == ["transfer", "prep"]
    assert [ln.get_label() for ln in second.get_lines()] == ["batch"]
    assert "measured in the same run" in fig.get_supxlabel()


@pytest.mark.parametrize("suffix,magic", [("svg", b"<?xml"), ("png", b"\x89PNG"), ("pdf", b"%PDF")])
def test_save_writes_the_format_its_name_says(tmp_path, suffix, magic):
    path = tmp_path / f"chart.{suffix}"
    save(PANELS, str(path), note="n")
    assert path.read_bytes().startswith(magic)


def test_chart_refusals_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="x and y > 0"):
        figure([Panel("t", "x", "y", {"a": [(0, 1.0)]})])
    with pytest.raises(ValueError, match="no points"):
        figure([Panel("t", "x", "y", {"a": []})])
    with pytest.raises(ValueError, match=r"\.svg, \.png or \.pdf"):
        save(PANELS, str(tmp_path / "chart.txt"))
    assert not (tmp_path / "chart.txt").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_shows_at_once_and_ends_its_line():
    out = _Terminal()
    with progress("filling", 3, unit="request", stream=out) as bar:
        for _ in range(3):
            bar.update()
    text = out.getvalue()
    assert "filling" in text and "3/3" in text and text.endswith("\n")


def test_progress_into_a_file_stays_quiet_for_a_short_phase():
    out = io.StringIO()
    with progress("filling", 3, stream=out) as bar:
        bar.update(3)
    with ticker("starting", stream=out):
        pass
    assert out.getvalue() == ""
    assert DELAY_S >= 1


def test_ticker_redraws_the_elapsed_time_by_itself():
    out = _Terminal()
    label = "starting 2 engine processes: "
    with ticker("starting 2 engine processes", stream=out):
        # drawn once when it starts; then only the ticker's thread draws (every 0.2 s)
        deadline = time.monotonic() + 60
        while out.getvalue().count(label) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        drawn_inside = out.getvalue().count(label)
    assert drawn_inside >= 3
    assert out.getvalue().endswith("\n")
