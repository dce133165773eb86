"""The whole plan between a prefill engine and a decode engine."""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import block_size_ratio
from .compat import check_compatible
from .layout import ElementLayout, element_layout
from .plan import ProducerRankPlan, RankPlan, plan_rank, producer_plans
from .reads import tp_ratio
from .spec import EngineSpec, HeadOrder


@dataclass(frozen=True)
class PostProcess:
    """Rearrangement a decode rank applies to received blocks, if any.

    Received bytes of one local physical (kernel) block are ``units_per_block`` units, each in the
    remote head order (``source_order``) with ``unit_tokens`` tokens; the local
    cache wants one block in ``target_order`` with all the tokens.
    """

    needed: bool
    units_per_block: int
    unit_tokens: int
    source_order: HeadOrder
    target_order: HeadOrder


@dataclass(frozen=True)
class TransferPlan:
    """Decode-centric plan: the decode engine reads (pull) or is written to (push)."""

    prefill: EngineSpec
    decode: EngineSpec
    tp_ratio: int | None
    #: larger block size / smaller block size (>= 1, direction-free; see
    #: :attr:`decode_over_prefill_block_size` for the direction, which the JSON calls
    #: ``block_size_ratio``)
    block_size_ratio: int
    decode_ranks: tuple[RankPlan, ...]
    prefill_ranks: tuple[ProducerRankPlan, ...]
    decode_layout: ElementLayout
    prefill_layout: ElementLayout
    post_process: PostProcess
    warnings: tuple[str, ...]

    @property
    def decode_over_prefill_block_size(self) -> int | float:
        """Decode block size / prefill block size: an int when the decode blocks are the larger
        (or equal) ones, else a fraction such as ``0.5`` (the JSON ``block_size_ratio``)."""
        d, p = self.decode.block_size, self.prefill.block_size
        return d // p if d % p == 0 else d / p

    def rank(self, decode_rank: int) -> RankPlan:
        return self.decode_ranks[decode_rank]

    def descriptors_per_block(self, decode_rank: int) -> int:
        """Attention descriptors one decode rank posts per (decode) block of one request, all
        layers (Mamba state: :meth:`mamba_descriptors_per_request`)."""
        p = self.decode_ranks[decode_rank]
        lay = self.decode_layout
        units = max(1, self.decode.block_size // p.unit_tokens)
        return lay.regions * lay.elements_per_block * len(p.reads) * units

    def mamba_descriptors_per_request(self, decode_rank: int) -> int:
        """Mamba state descriptors one decode rank posts per request, all layer regions: one
        per x / B / C / SSM piece and region for the request's state page (0 without Mamba).
        They come on top of :meth:`descriptors_per_block`, which counts attention only."""
        p = self.decode_ranks[decode_rank]
        if p.mamba is None:
            return 0
        return self.decode_layout.regions * len(p.mamba.mamba_pieces)

    def mamba_bytes_per_request(self, decode_rank: int) -> int:
        """Mamba conv + SSM state bytes one decode rank receives per request (its shard of one
        state page per layer region; 0 without Mamba). Not included in :meth:`bytes_per_token`."""
        p = self.decode_ranks[decode_rank]
        if p.mamba is None:
            return 0
        return self.decode_layout.regions * sum(x.length for x in p.mamba.mamba_pieces)

    def bytes_per_token(self, decode_rank: int) -> int:
        """KV bytes one decode rank receives per token (all layers; Mamba state:
        :meth:`mamba_bytes_per_request`)."""
        return self.decode.bytes_per_token


def plan_transfer(prefill: EngineSpec, decode: EngineSpec) -> TransferPlan:
    """Plan every decode rank's reads from ``prefill`` and every prefill rank's expectations."""
    check_compatible(decode, prefill)
    ranks = tuple(plan_rank(decode, prefill, r) for r in range(decode.tp_size))
    producers = producer_plans(ranks, prefill.tp_size)
    ratio = block_size_ratio(decode.block_size, prefill.block_size)
    unit_tok = min(decode.kernel_block_size, prefill.kernel_block_size)
    units_per_block = decode.kernel_block_size // unit_tok  # per physical (kernel) block
    multi_head = decode.heads_per_rank > 1 and not decode.use_mla
    needed = not decode.use_mla and (
        (prefill.head_order is not decode.head_order and multi_head)
        or (units_per_block > 1 and multi_head and prefill.head_order is HeadOrder.HND)
    )
    post = PostProcess(needed, units_per_block, unit_tok, prefill.head_order, decode.head_order)
    warnings: list[str] = []
    if tp_ratio(decode.tp_size, prefill.tp_size) is None:
        warnings.append(
            f"TP sizes {prefill.tp_size} and {decode.tp_size} do not divide each other; served "
            "through general head-interval reads (vLLM's NixlConnector refuses this pair)"
        )
    if any(p.notify_only_ranks for p in ranks) and not decode.use_mla:
        warnings.append(
            "some prefill ranks hold only duplicate heads: they are notified, not read "
            "(vLLM's NixlConnector refuses this pair)"
        )
    if needed:
        warnings.append(
            "received blocks are rearranged on the decode side after each transfer "
            f"({prefill.head_order.value} -> {decode.head_order.value}, {units_per_block} unit(s) per block)"
        )
    idle = [p.rank for p in producers if p.notifications_per_request == 0]
    if idle:
        warnings.append(f"prefill ranks {idle} are never read: they release blocks at once")
    return TransferPlan(
        prefill=prefill,
        decode=decode,
        tp_ratio=tp_ratio(decode.tp_size, prefill.tp_size),
        block_size_ratio=ratio,
        decode_ranks=ranks,
        prefill_ranks=producers,
        decode_layout=element_layout(decode),
        prefill_layout=element_layout(prefill),
        post_process=post,
        warnings=tuple(warnings),
    )
