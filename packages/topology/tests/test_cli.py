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


def test_plan_larger_prefill_blocks_with_several_heads_hnd():
    # was refused (exit 2); one read per head, 16-token units of 32-token prefill blocks
    base = ["plan", "--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "8",
            "--prefill-block-size", "32", "--decode-block-size", "16"]
    out = run(*base)
    assert out.returncode == 0, out.stderr
    assert "heads are read one by one" in out.stdout
    # head 4096 bytes per 16 tokens (128 x bf16): P2's heads at 0 and 8192 of its 32-token element
    assert "D1: sources [2, 3]  reads P2[0:4096]->@0, P2[8192:12288]->@4096, " in out.stdout
    doc = json.loads(run(*base, "--json").stdout)
    assert doc["block_size_ratio"] == 0.5 and doc["unit_tokens"] == 16
    d0 = doc["decode_ranks"][0]
    assert d0["remote_unit_bytes"] == 8192 and d0["remote_unit_stride"] == 4096
    assert [r["remote_offset"] for r in d0["reads"]] == [0, 8192, 0, 8192]
    assert d0["descriptors_per_block"] == 80 * 2 * 4
    # equal block sizes: units are contiguous, the stride is the unit
    doc = json.loads(run("plan", "--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "8",
                         "--json").stdout)
    assert all(d["remote_unit_stride"] == d["remote_unit_bytes"] for d in doc["decode_ranks"])


def test_plan_mamba_text_counts_the_state_pieces():
    base = ["plan", "--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "8", "--mamba"]
    out = run(*base)
    assert out.returncode == 0, out.stderr
    # per layer and decode rank (TP 2): x 32 heads x 64 x 3 x 2 B, B and C 4 groups x 128 x 3
    # x 2 B, SSM 32 x 64 x 128 x 4 B = 1,067,008 B; x 80 layer regions = 81.4 MiB per request
    assert "+ Mamba-2 state (conv x/B/C + SSM, one state page per request in each of 80 layer " \
           "regions): 81.4 MiB per request per decode rank, 162.8 MiB per request in all" in out.stdout
    assert "per decode block per rank (attention KV)" in out.stdout
    # 8 pieces (x, B, C, SSM from each of two prefill ranks) x 80 regions
    assert "descriptors/block 320 attention + 640/request Mamba state" in out.stdout
    assert "x P0[0:6144]->@0, x P1[0:6144]->@6144, B P0[6144:7680]->@12288" in out.stdout
    d0 = json.loads(run(*base, "--json").stdout)["decode_ranks"][0]
    assert d0["mamba_descriptors_per_request"] == 640 and d0["descriptors_per_block"] == 320
    assert d0["mamba_state_bytes_per_request"] == 80 * 1_067_008
    assert sum(p["length"] for p in d0["mamba_pieces"]) == 1_067_008
    plain = run("plan", "--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "8")
    assert "Mamba" not in plain.stdout and "attention KV" not in plain.stdout


def test_plan_svg_is_wellformed(tmp_path):
    svg = tmp_path / "plan.svg"
    out = run("plan", "--prefill-tp", "16", "--decode-tp", "8", "--kv-heads", "8", "--svg", str(svg))
    assert out.returncode == 0, out.stderr
    root = ET.parse(svg).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("notify only") == 8
    assert sum(1 for t in texts if t and t.startswith("read ")) == 8


def test_plan_packed_layout_text_json_svg(tmp_path):
    base = ["plan", "--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "8", "--layout", "packed"]
    out = run(*base)
    assert out.returncode == 0, out.stderr
    assert "prefill: TP 4, 2 head(s)/rank, block 16 tokens, packed HND" in out.stdout
    assert "within one packed K+V element of a 16-token unit" in out.stdout
    # each P rank's whole element (2 heads x K and V x 16 tokens x 128 x 2 B) side by side
    assert "D1: sources [2, 3]  reads P2[0:16384]->@0, P3[0:16384]->@16384" in out.stdout
    assert "descriptors/block 160" in out.stdout  # 80 layers x one region x 2 reads
    assert "160.0 KiB per token per decode rank" in out.stdout  # same bytes as kv-first
    doc = json.loads(run(*base, "--json").stdout)
    for side in ("prefill", "decode"):
        assert doc[side]["layout"] == "packed"
    assert doc["decode"]["element_bytes"] == doc["decode"]["region_block_bytes"] == 4 * 8192
    assert doc["post_process"]["needed"] is False
    assert doc["decode_ranks"][1]["reads"][1] == {
        "prefill_rank": 3, "remote_offset": 0, "length": 16384, "local_offset": 16384}
    svg = tmp_path / "packed.svg"
    assert run(*base, "--svg", str(svg)).returncode == 0
    texts = [t.text for t in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("read 16384 B @0") == 4


def test_plan_measured_block_bytes_larger_than_computed():
    # padded pages: a prefill K block of 1 head x 16 tokens x 128 x 2 B = 4096 B measured as 4608,
    # a decode K block of 4 heads (16384 B) as 16896; the reads still move only the heads
    base = ["plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8", "--json"]
    computed = json.loads(run(*base).stdout)
    out = run(*base, "--prefill-block-bytes", "4608", "--decode-block-bytes", "16896")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["prefill"]["region_block_bytes"] == doc["prefill"]["element_bytes"] == 4608
    assert doc["decode"]["region_block_bytes"] == doc["decode"]["element_bytes"] == 16896
    assert computed["prefill"]["region_block_bytes"] == 4096
    assert computed["decode"]["region_block_bytes"] == 16384
    assert doc["decode_ranks"] == computed["decode_ranks"]  # same reads, units and descriptors
    assert doc["decode_ranks"][1]["reads"][0] == {
        "prefill_rank": 4, "remote_offset": 0, "length": 4096, "local_offset": 0}
    # blocks-first: the measured page holds K then V, each half of it
    out = run(*base, "--layout", "blocks-first", "--decode-block-bytes", str(2 * 16384 + 1024))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["decode"]["element_bytes"] == 16384 + 512
    # the text report takes them too
    out = run("plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8",
              "--prefill-block-bytes", "4608")
    assert out.returncode == 0 and "D1: sources [4, 5, 6, 7]" in out.stdout


@pytest.mark.parametrize(
    "flag, value, needle",
    [
        ("--prefill-block-bytes", "4000",
         "engine 'prefill': measured block_bytes 4000 is smaller than the 4096 bytes"),
        ("--decode-block-bytes", "16383",
         "engine 'decode': measured block_bytes 16383 is smaller than the 16384 bytes"),
        ("--decode-block-bytes", "0", "block_bytes must be a positive integer"),
    ],
)
def test_plan_inconsistent_block_bytes_exit_2(flag, value, needle):
    out = run("plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8", flag, value)
    assert out.returncode == 2 and out.stdout == ""
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_plan_block_bytes_that_do_not_halve_into_k_and_v_exit_2():
    out = run("plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8", "--layout",
              "blocks-first", "--decode-block-bytes", str(2 * 16384 + 1))
    assert out.returncode == 2
    assert "block_bytes 32769 does not split into 2 equal K/V halves" in out.stderr
    out = run("plan", "--prefill-tp", "8", "--decode-tp", "2", "--kv-heads", "8",
              "--prefill-block-bytes", "lots")
    assert out.returncode == 2 and "invalid int value: 'lots'" in out.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prefill-tp", "3", "--decode-tp", "1", "--kv-heads", "8"], "use a TP size that divides 8"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--layout", "packed", "--mla"],
         "use layout kv-first"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--layout", "kv-first", "--mamba"],
         "set layout to blocks-first or packed"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--layout", "packed", "--mamba",
          "--head-order", "NHD"], "vLLM's LBHNC layout"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--layout", "packed",
          "--decode-block-size", "32"], "equal kernel (physical) block sizes"),
        (["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "8", "--layout", "packed",
          "--head-order", "NHD"], "set both engines' KV cache layout to HND"),
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


def test_plan_prints_the_warnings_header_only_with_warnings():
    quiet = run("plan", "--prefill-tp", "2", "--decode-tp", "2", "--kv-heads", "8")
    assert quiet.returncode == 0, quiet.stderr
    assert "warnings" not in quiet.stdout
    loud = run("plan", "--prefill-tp", "3", "--decode-tp", "2", "--kv-heads", "6")
    assert loud.returncode == 0, loud.stderr
    lines = loud.stdout.splitlines()
    at = lines.index("warnings:")
    assert lines[at + 1].startswith("  - TP sizes 3 and 2 do not divide each other")
    assert all(line.startswith("  - ") for line in lines[at + 1:])
