"""MLA through the connector's halves, without vLLM: the cache tensors are shaped
exactly as vLLM 0.32's CPU_MLA backend hands them to the connector (one latent
vector per token and layer: ``[blocks, 1, block_size, kv_lora_rank +
qk_rope_head_dim]``, seen in a real engine), registration
describes them as one replicated "head", and a prefill engine of TP 2 serves a
decode engine of TP 1 with one READ from one rank and a notice to the other
(which holds the same bytes), over real NIXL agents and a real side channel."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from halves_wiring import SchedulerHalves, alloc

from kvbridge.tools.ports import free_port
from kvbridge.vllm import (
    ConnectorConfig,
    EngineRoles,
    prefill_request_params,
    register_caches,
    worker_half,
)

pytestmark = pytest.mark.timeout(120)

LAYERS, NB, BLOCK, LATENT = 2, 12, 16, 512 + 64  # DeepSeek: kv_lora_rank 512 + rope 64
CFG = ConnectorConfig(ucx_threads=0, huge_pages=False, lease_seconds=30,
                      handshake_timeout_seconds=2, transfer_timeout_seconds=10)
PREFILL, DECODE = EngineRoles(producer=True, consumer=False), EngineRoles(producer=False, consumer=True)


def _vllm_config(tp: int) -> SimpleNamespace:
    mc = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 1,
                         get_head_size=lambda: LATENT, get_vocab_size=lambda: 1024,
                         hf_config=SimpleNamespace(architectures=["DeepseekV2ForCausalLM"],
                                                   hidden_size=128, num_attention_heads=4))
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"))


def _mla_caches(fill: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """vLLM 0.32's MLA cache per layer: [num_blocks, 1, block_size, latent] (every TP rank
    the same)."""
    return {f"model.layers.{i}.self_attn.attn": (fill[i].clone() if fill is not None else
                                                 torch.zeros(NB, 1, BLOCK, LATENT))
            for i in range(LAYERS)}



class MlaEngine:
    """One engine of ``tp`` ranks: a scheduler half and one worker half per rank."""

    def __init__(self, engine_id: str, roles: EngineRoles, tp: int, fill: torch.Tensor | None) -> None:
        self.port = free_port()
        self.sched = SchedulerHalves(engine_id=engine_id, block_size=BLOCK, tp_size=tp, config=CFG,
                                   port=self.port, roles=roles)
        self.caches, self.workers, payloads = [], [], {}
        for rank in range(tp):
            caches = _mla_caches(fill)
            reg = register_caches(_vllm_config(tp), SimpleNamespace(num_blocks=NB), caches, CFG,
                                  engine_id=engine_id, attention_backend="CPU_MLA")
            self.spec = reg.spec
            w = worker_half(rank, roles, CFG)
            w.register(reg.spec, reg.regions, reg.engine_config, incarnation=f"{engine_id}-1",
                       address=(CFG.side_channel_host, self.port), layer_names=reg.layer_names)
            hs = w.handshake()
            if hs is not None:
                payloads[rank] = (*hs, w.compat_info())
            self.caches.append(caches)
            self.workers.append(w)
        self.sched.serve(payloads)

    def step(self) -> tuple[set, set, set]:
        orders = self.sched.mode.take_orders()
        sent, recved, failed = set(), set(), set()
        for w in self.workers:
            w.start(orders)
            r = w.results()
            sent |= r.finished_sending
            recved |= r.finished_recving
            failed |= r.failed_recving
        return sent, recved, failed

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.sched.close()


def test_mla_registration_describes_one_replicated_latent_head() -> None:
    e = MlaEngine("P", PREFILL, 2, torch.rand(LAYERS, NB, 1, BLOCK, LATENT))
    try:
        s = e.spec
        assert (s.use_mla, s.num_kv_heads, s.head_dim, s.tp_size, s.num_layers) == (True, 1, LATENT, 2, 2)
        assert s.dtype == "fp32"
    finally:
        e.close()


def test_mla_tp2_prefill_to_tp1_decode_reads_once_and_notifies_the_other_rank() -> None:
    fill = torch.rand(LAYERS, NB, 1, BLOCK, LATENT, generator=torch.Generator().manual_seed(3))
    p, d = MlaEngine("P", PREFILL, 2, fill), MlaEngine("D", DECODE, 1, None)
    try:
        _, params = p.sched.mode.finished("p-1", prefill_request_params(), completed=True,
                                           block_ids=([3, 5, 7, 11],), num_computed_tokens=50,
                                           num_prompt_tokens=50)
        assert params["tp_size"] == 2
        assert d.sched.mode.matched_tokens("d-1", params, 50, 0) == (49, True)
        d.sched.mode.after_alloc("d-1", params, 50, alloc([[2, 9, 4, 6]], 0), 49)
        sent_per_rank: list[set] = [set(), set()]
        recved, failed = set(), set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not ("d-1" in recved and all(sent_per_rank)):
            _, r, f = d.step()
            recved |= r
            failed |= f
            orders = p.sched.mode.take_orders()
            for rank, w in enumerate(p.workers):
                w.start(orders)
                sent_per_rank[rank] |= w.results().finished_sending
            time.sleep(0.005)
        # every prefill rank released the request (one was read, the other only notified)
        assert (recved, failed, sent_per_rank) == ({"d-1"}, set(), [{"p-1"}, {"p-1"}])
        for name in d.caches[0]:
            assert torch.equal(d.caches[0][name][[2, 9, 4, 6]], fill[int(name.split(".")[2])][[3, 5, 7, 11]])
            assert not d.caches[0][name][[0, 1, 3, 5, 7, 8, 10, 11]].any()
        stats = d.workers[0].take_stats()
        # one READ (from one rank) of 4 blocks x 2 layers of latents; no second read
        assert len(stats["bytes_transferred"]) == 1
        assert sum(stats["bytes_transferred"]) == 4 * LAYERS * BLOCK * LATENT * 4
    finally:
        d.close()
        p.close()
