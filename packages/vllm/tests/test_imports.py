"""The adapter's pure parts must import without vLLM, torch or NIXL."""

from __future__ import annotations

import subprocess
import sys


def test_pure_modules_import_without_heavy_dependencies() -> None:
    code = (
        "import sys, kvbridge.vllm, kvbridge.vllm.config, kvbridge.vllm.params, "
        "kvbridge.vllm.stats, kvbridge.vllm.scheduling, kvbridge.vllm.steps, kvbridge.vllm.cachespec\n"
        "heavy = [m for m in ('vllm', 'torch', 'nixl', 'zmq') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
