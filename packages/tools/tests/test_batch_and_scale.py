"""Requests handed over together (``Cluster.submit_batch``, what ``kvbridge demo`` measures) and
``kvbridge bench --scale`` at a tiny size: real processes, real NIXL/UCX, ZMQ on 127.0.0.1."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from kvbridge.nixl import EngineConfig
from kvbridge.tools.bench import bench_command
from kvbridge.tools.harness import Cluster, spec_pair
from kvbridge.tools.scale import Checkpoint, flatness_verdict

pytestmark = pytest.mark.timeout(400)


def _batch(first: int, n: int, blocks: int, ntok: int) -> list[tuple]:
    return [(f"b{i}", 500 + i, list(range(i * blocks, (i + 1) * blocks)),
             list(range((n - 1 - (i - first)) * blocks, (n - (i - first)) * blocks)), ntok)
            for i in range(first, first + n)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_batch_is_in_flight_together_on_every_rank(mode):
    """One at a time (each awaited before the next) a rank never has two requests; a batch puts
    every request on every rank before any completes, and each is still verified byte for byte."""
    p, d = spec_pair(prefill_tp=2, decode_tp=2, kv_heads=4, head_dim=32, layers=2)
    n, blocks = 4, 3
    with Cluster(p, d, num_blocks=n * blocks, config=EngineConfig(mode=mode)) as c:
        for i in range(2):  # the control: sequential requests
            pb = list(range(i * blocks, (i + 1) * blocks))
            c.submit(f"one-{i}", 100 + i, pb, pb)
            (r,) = c.wait([f"one-{i}"], timeout=120, released=mode == "pull").values()
            assert r.ok and set(r.done) == {0, 1}, r
        mover, other = (c.decode, c.prefill) if mode == "pull" else (c.prefill, c.decode)
        assert {rank: req for rank, (req, _) in c.peaks(c.decode).items()} == {0: 1, 1: 1}
        batch = _batch(0, n, blocks, blocks * 16)
        for _, seed, pb, _, ntok in batch:
            c.fill(seed, pb, ntok)
        if mode == "pull":  # the decode blocks zeroed ahead (as the demo does), else at the load
            c.clear_decode([b for *_, db, _ in batch for b in db])
        c.submit_batch(batch, cleared=mode == "pull")
        res = c.wait([b[0] for b in batch], timeout=120, released=mode == "pull")
        for rid, r in res.items():
            assert not r.failed and set(r.done) == {0, 1} and r.mismatches == 0, (rid, r)
        # every rank of both engines had the whole batch outstanding at once
        for group in (mover, other):
            assert {rank: req for rank, (req, _) in c.peaks(group).items()} == {0: n, 1: n}
        # the moving ranks held NIXL transfer handles for at least one request at some point
        assert all(x >= 1 for _, x in c.peaks(mover).values())
        assert not c.duplicates


def test_flatness_rule():
    res = {"transfers": 0, "lists": 4}
    cps = [Checkpoint(10, res, {"decode 0": 100.0}), Checkpoint(20, res, {"decode 0": 103.0})]
    assert flatness_verdict(cps, slack_mib=4)[0]
    assert not flatness_verdict(cps, slack_mib=2)[0]
    leak = [cps[0], Checkpoint(20, {"transfers": 2, "lists": 4}, {"decode 0": 100.0})]
    flat, why = flatness_verdict(leak)
    assert not flat and "GROWING" in why and "transfers" in why
    with pytest.raises(ValueError):
        flatness_verdict(cps[:1])


def test_bench_scale_tiny_run(capsys, tmp_path):
    """Every sweep of ``kvbridge bench --scale`` at a tiny size (sizes only, nothing timed), the
    flatness verdict over 20 requests, and the SVG chart (its text kept as text)."""
    svg = tmp_path / "scale.svg"
    rc = bench_command(["--scale", "--blocks", "1,10", "--inflight", "1,3", "--total", "20",
                        "--checkpoints", "10", "--reps", "1", "--plot", str(svg)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FLAT: " in out and "blocks per request" in out and "requests in flight" in out
    assert "after     10 requests" in out and "after     20 requests" in out
    root = ET.fromstring(svg.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = " ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for words in ("Cost per request vs blocks per request", "Requests in flight (128 blocks each)",
                  "transfer (load to completion)", "descriptor preparation",
                  "batch (submission to last completion)", "median request (load to completion)",
                  "blocks per request", "requests in flight", "FLAT"):
        assert words in text, words


def test_bench_scale_refuses_bad_flags(capsys):
    with pytest.raises(SystemExit):
        bench_command(["--scale", "--blocks", "0,10"])
    assert bench_command(["--scale", "--total", "5", "--checkpoints", "10"]) == 2
    assert "two checkpoints" in capsys.readouterr().err
    assert bench_command(["--scale", "--plot", "curves.txt"]) == 2
    assert ".svg, .png or .pdf" in capsys.readouterr().err
