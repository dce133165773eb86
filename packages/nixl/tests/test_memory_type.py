"""The engine's memory type agrees with its cache, and its worker thread binds the cache's
device (CPU side of the CUDA path; the transfers on GPU memory are in kvbridge-tools'
cuda-marked tests)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvbridge.nixl import AgentConfig, DecodeEngine, EngineConfig, NixlAgent
from kvbridge.nixl.worker import Worker
from kvbridge.topology import EngineSpec


def _spec() -> EngineSpec:
    return EngineSpec(engine_id="mt", tp_size=1, num_kv_heads=2, head_dim=8, num_layers=1,
                      block_size=4, dtype="fp16")


def test_host_cache_with_vram_config_is_refused_with_advice():
    caches = [torch.zeros((2, 4, 4, 2, 8), dtype=torch.float16)]
    with pytest.raises(ValueError, match=r"in DRAM memory but EngineConfig.mem_type is 'VRAM'; "
                                         r"set mem_type='DRAM'"):
        DecodeEngine(_spec(), 0, caches, EngineConfig(mem_type="VRAM"))


def test_worker_runs_its_start_call_on_its_own_thread_first():
    seen: list[str] = []
    agent = NixlAgent("mt-worker", AgentConfig(num_threads=0))
    try:
        w = Worker(agent, "mt-thread", 0.0, on_start=lambda: seen.append(threading.current_thread().name))
        done = threading.Event()
        w.submit(lambda: done.set())
        assert done.wait(10)
        w.close(5)
    finally:
        agent.close()
    assert seen == ["mt-thread"]
