"""`kvbridge demo --mamba` as a user runs it: a hybrid attention + Mamba-2 model moved between
engine processes (real NIXL, real ZMQ), every attention byte and every byte of the x / B / C /
SSM state shards verified, for P > D, D > P and equal TP, pull and push, in the blocks-first and
the packed layout."""

from __future__ import annotations

import re

import pytest

from kvbridge.tools.demo import demo_command

pytestmark = pytest.mark.timeout(400)

CASES = [
    # prefill TP, decode TP, mode, KV heads (1: prefill rank 1 holds only a duplicate head, so
    # it is read for its Mamba state alone). The other TP/mode pairs run in one process in
    # packages/nixl/tests/test_hybrid.py; each case here starts engine processes (~10 s each)
    (2, 1, "pull", 1),
    (2, 1, "push", 2),
    (1, 2, "push", 2),
    (2, 2, "pull", 2),
]
#: vLLM 0.32's packed layout (one fp32 K+V element per page, heads HND), as Granite-4.0-H
PACKED = [(2, 1, "pull", 2), (1, 2, "push", 2)]


@pytest.mark.parametrize("p_tp,d_tp,mode,kv_heads", CASES,
                         ids=[f"P{p}-D{d}-{m}-K{k}" for p, d, m, k in CASES])
def test_demo_mamba_verifies_every_byte(capsys, p_tp, d_tp, mode, kv_heads):
    rc = demo_command(["--mamba", "--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
                       "--mode", mode, "--kv-heads", str(kv_heads), "--head-dim", "16",
                       "--layers", "2", "--blocks", "3", "--requests", "2", "--rounds", "1",
                       "--ssm-heads", "4", "--ssm-head-dim", "8", "--ssm-state", "8",
                       "--ssm-groups", "2", "--ranks-per-process", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "demo: OK, every byte verified" in out
    # (the first request + the batch of 2) x decode ranks, each shard with its Mamba state
    assert f"decode verified {3 * d_tp} rank shards" in out
    assert "one Mamba state page per request" in out and "mamba state pieces" in out
    if kv_heads == 1:  # the plan reads prefill rank 1 for the Mamba state only
        assert re.search(r"FA sources \[0\], all sources \[0, 1\].*FA emptied for \[1\]", out), out


@pytest.mark.parametrize("p_tp,d_tp,mode,kv_heads", PACKED,
                         ids=[f"packed-P{p}-D{d}-{m}" for p, d, m, _ in PACKED])
def test_demo_mamba_packed_verifies_every_byte(capsys, p_tp, d_tp, mode, kv_heads):
    rc = demo_command(["--mamba", "--layout", "packed", "--dtype", "fp32", "--prefill-tp", str(p_tp),
                       "--decode-tp", str(d_tp), "--mode", mode, "--kv-heads", str(kv_heads),
                       "--head-dim", "16", "--layers", "2", "--blocks", "3", "--requests", "2",
                       "--rounds", "1", "--ssm-heads", "4", "--ssm-head-dim", "8", "--ssm-state",
                       "8", "--ssm-groups", "2", "--ranks-per-process", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "packed HND, Mamba hybrid" in out and "packed K+V element" in out
    assert "demo: OK, every byte verified" in out
    assert f"decode verified {3 * d_tp} rank shards" in out
    assert "mamba state pieces" in out


def test_demo_mamba_packed_nhd_split_by_head_is_refused(capsys):
    rc = demo_command(["--mamba", "--layout", "packed", "--head-order", "NHD", "--prefill-tp", "2",
                       "--decode-tp", "1", "--kv-heads", "2", "--head-dim", "16", "--layers", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "vLLM's LBHNC layout" in err, err
