"""`kvbridge demo` and `kvbridge bench` as a user runs them (real processes, real NIXL)."""

from __future__ import annotations

import json
import re

import pytest

from kvbridge.tools.bench import KEYS, bench_command
from kvbridge.tools.demo import demo_command

pytestmark = pytest.mark.timeout(400)


def test_demo_small_verifies_every_byte(capsys):
    rc = demo_command(["--blocks", "3", "--requests", "2", "--layers", "2", "--head-dim", "16",
                       "--kv-heads", "4", "--prefill-tp", "2", "--decode-tp", "4", "--ranks-per-process", "4",
                       "--rounds", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "demo: OK, every byte verified" in out
    # (the first request + the batch of 2 moved twice) x 4 decode ranks
    assert "decode verified 20 rank shards" in out
    assert "handshake (slowest rank)" in out and "first request, alone" in out
    # the descriptor count handed to NIXL, and NIXL's merged count from its telemetry
    assert re.search(r"\(\d+ descriptors posted; NIXL merged them into \d+\)", out), out
    # the batch was handed to every decode rank at once: both requests outstanding on each
    for rank in range(4):
        assert re.search(rf"decode rank {rank}: .* GB/s \(\d+ % of memcpy\); at most 2 requests outstanding",
                         out), out
    assert re.search(r"moved 2 time\(s\): \d+\.\d+, \d+\.\d+ GB/s aggregate", out), out
    assert re.search(r"aggregate \(best round\): .* % of memcpy .* target >= 50 %: (PASS|FAIL)", out), out


def test_demo_refuses_impossible_shapes(capsys):
    assert demo_command(["--prefill-tp", "3", "--kv-heads", "8"]) == 2
    assert "cannot be split evenly" in capsys.readouterr().err
    assert demo_command(["--blocks", "0"]) == 2
    assert demo_command(["--rounds", "0"]) == 2


def test_bench_json_has_exactly_the_documented_keys(capsys):
    rc = bench_command(["--json", "--tokens", "64", "--requests", "1", "--repeats", "1", "--ucx-threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    assert tuple(data) == KEYS
    assert all(isinstance(v, float) and v > 0 for v in data.values())
    assert data["naive_desc_prep_ms"] > data["desc_prep_ms"]


def test_demo_help_names_only_flags_it_has(capsys):
    with pytest.raises(SystemExit) as exc:
        demo_command(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--layout" in out and "--mamba" in out and "--ssm-heads" in out
