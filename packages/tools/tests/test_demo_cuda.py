"""`kvbridge demo --device cuda`: the same transfers with the caches in GPU memory (NIXL VRAM).

Marked ``cuda``: run by ``uv run nox -s gpu`` on a machine with a CUDA device (skipped
elsewhere). The engines run in real processes on the same GPU; every byte is verified.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvbridge.tools.demo import demo_command

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = ["--blocks", "4", "--requests", "3", "--layers", "2", "--head-dim", "64", "--kv-heads", "4",
         "--rounds", "2", "--device", "cuda"]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "mode"), [
    (1, 1, "pull"), (2, 1, "pull"), (1, 2, "pull"), (2, 1, "push"),
])
def test_demo_on_gpu_memory_verifies_every_byte(capsys, prefill_tp, decode_tp, mode):
    rc = demo_command([*SMALL, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                       "--mode", mode])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert "demo: OK, every byte verified" in out
    assert re.search(r"aggregate \(best round\): .* % of GPU copy .*cuda:0 to cuda:0", out), out


def test_demo_mamba_hybrid_on_gpu_memory(capsys):
    rc = demo_command([*SMALL, "--mamba", "--prefill-tp", "2", "--decode-tp", "1"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert "demo: OK, every byte verified" in out


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_demo_across_several_gpu_allocations(capsys, mode):
    """Layer tensors over 10 MiB each get their own cudaMalloc, often back to back in the
    address space: every WRITE or READ must still land (a registration row spanning two
    allocations made every push WRITE fail on an H100)."""
    rc = demo_command(["--blocks", "64", "--requests", "3", "--layers", "2", "--rounds", "1",
                       "--device", "cuda", "--prefill-tp", "2", "--decode-tp", "1", "--mode", mode])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert "demo: OK, every byte verified" in out
