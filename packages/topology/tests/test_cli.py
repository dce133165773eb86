"""The kvbridge command, run as a real subprocess through its console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from kvbridge.topology.cli import main

EXE = shutil.which("kvbridge")


def run(*args: str) -> subprocess.CompletedProcess:
    cmd = [EXE, *args] if EXE else [sys.executable, "-m", "kvbridge.topology.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_plan_table_p8_d2():
    out = run("plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8")
    assert out.returncode == 0, out.stderr
    assert "D1: sources [4, 5, 6, 7]" in out.stdout
    assert "P5: consumers ['D1']  notifications/request 1" in out.stdout
    assert "160.0 KiB per token per decode rank" in out.stdout  # 80 x 2 x 4 x 128 x 2 B


def test_plan_json_schema_keys():
    out = run("plan", "--prefill-tp", "2", "--decode-tp", "8", "--kv-heads", "8", "--json")
    doc = json.loads(out.stdout)
    assert doc["schema"] == "kvbridge.plan/1"
    assert doc["tp_ratio"] == 4 and doc["block_size_ratio"] == 1
    d5 = doc["decode_ranks"][5]
    assert set(d5) >= {"rank", "handshake_ranks", "source_ranks", "notify_only_ranks", "reads"}
    assert d5["reads"] == [{"prefill_rank": 1, "remote_offset": 4096, "length": 4096, "local_offset": 0}]
    assert doc["prefill_ranks"][0] == {
        "rank": 0, "consumer_ranks": [0, 1, 2, 3], "notifications_per_request": 4,
        "read_by": [0, 1, 2, 3], "notify_only_from": [],
    }


def test_plan_json_mamba_keys_and_block_ratio():
    out = run("plan", "--prefill-tp", "4", "--decode-tp", "1", "--kv-heads", "8", "--mamba",
              "--decode-block-size", "16", "--json")
    doc = json.loads(out.stdout)
    d0 = doc["decode_ranks"][0]
    for key in ("fa_source_ranks", "num_fa_reads", "num_mamba_reads", "fa_descriptor_bytes",
                "fa_rank_offset", "needs_split_handles", "fa_head_slots", "remote_replicated",
                "remote_physical_heads"):
        assert key in d0, key
    assert d0["fa_head_slots"] == {"0": 0, "1": 1, "2": 2, "3": 3}
    out = run("plan", "--prefill-tp", "1", "--decode-tp", "1", "--kv-heads", "8",
              "--prefill-block-size", "32", "--decode-block-size", "16", "--head-order", "NHD", "--json")
    assert json.loads(out.stdout)["block_size_ratio"] == 0.5


def test_plan_svg_is_wellformed(tmp_path):
    svg = tmp_path / "plan.svg"
    out = run("plan", "--prefill-tp", "16", "--decode-tp", "8", "--kv-heads", "8", "--svg", str(svg))
    assert out.returncode == 0, out.stderr
    root = ET.parse(svg).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("notify only") == 8
    assert sum(1 for t in texts if t and t.startswith("read ")) == 8


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prefill-tp", "3", "--decode-tp", "1", "--kv-heads", "8"], "use a TP size that divides 8"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--prefill-block-size", "24"],
         "must be a multiple"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--head-order", "NHD"], "HND"),
    ],
)
def test_invalid_shapes_exit_nonzero_without_traceback(args, needle):
    out = run("plan", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_command_and_help(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
