"""Render a TransferPlan as text, as a versioned JSON document, or as SVG."""

from __future__ import annotations

from html import escape
from typing import Any

from .heads import head_range
from .transfer import TransferPlan

SCHEMA = "kvbridge.plan/1"


def _engine_doc(spec) -> dict[str, Any]:
    return {
        "engine_id": spec.engine_id,
        "tp_size": spec.tp_size,
        "kv_heads": spec.num_kv_heads,
        "heads_per_rank": spec.heads_per_rank,
        "replicated": spec.is_replicated,
        "head_dim": spec.head_dim,
        "layers": spec.num_layers,
        "dtype": spec.dtype,
        "block_size": spec.block_size,
        "kernel_blocks_per_block": spec.kernel_blocks_per_block,
        "layout": spec.layout.value,
        "head_order": spec.head_order.value,
        "mla": spec.use_mla,
        "mamba": spec.mamba is not None,
        "region_block_bytes": spec.region_block_bytes,
        "element_bytes": spec.element_bytes,
        "bytes_per_token_per_rank": spec.bytes_per_token,
    }


def plan_to_json(plan: TransferPlan) -> dict[str, Any]:
    """The plan as a JSON-ready dict following docs/plan-schema.md (schema kvbridge.plan/1)."""
    decode_docs = []
    for p in plan.decode_ranks:
        d: dict[str, Any] = {
            "rank": p.local_rank,
            "handshake_ranks": list(p.handshake_ranks),
            "source_ranks": list(p.source_ranks),
            "notify_only_ranks": list(p.notify_only_ranks),
            "reads": [
                {
                    "prefill_rank": r.remote_rank,
                    "remote_offset": r.remote_offset,
                    "length": r.length,
                    "local_offset": r.local_offset,
                }
                for r in p.reads
            ],
            "unit_tokens": p.unit_tokens,
            "local_unit_bytes": p.local_unit_bytes,
            "remote_unit_bytes": p.remote_unit_bytes,
            "remote_unit_stride": p.remote_unit_stride,
            "descriptors_per_block": plan.descriptors_per_block(p.local_rank),
        }
        m = p.mamba
        if m is not None:
            d.update(
                fa_source_ranks=list(m.fa_source_ranks),
                all_source_ranks=list(m.all_source_ranks),
                num_fa_reads=m.num_fa_reads,
                num_mamba_reads=m.num_mamba_reads,
                fa_descriptor_bytes=m.fa_descriptor_bytes,
                fa_rank_offset=m.fa_rank_offset,
                needs_split_handles=m.needs_split_handles,
                fa_head_slots={str(q): s for q, s in m.fa_head_slots},
                remote_replicated=m.remote_replicated,
                remote_physical_heads=m.remote_physical_heads,
                fa_emptied_ranks=list(m.fa_emptied_ranks),
                mamba_descriptors_per_request=plan.mamba_descriptors_per_request(p.local_rank),
                mamba_state_bytes_per_request=plan.mamba_bytes_per_request(p.local_rank),
                mamba_pieces=[
                    {
                        "piece": x.name,
                        "prefill_rank": x.remote_rank,
                        "remote_offset": x.remote_offset,
                        "length": x.length,
                        "local_offset": x.local_offset,
                    }
                    for x in m.mamba_pieces
                ],
            )
        decode_docs.append(d)
    pp = plan.post_process
    return {
        "schema": SCHEMA,
        "prefill": _engine_doc(plan.prefill),
        "decode": _engine_doc(plan.decode),
        "tp_ratio": plan.tp_ratio,
        "block_size_ratio": plan.decode_over_prefill_block_size,
        "unit_tokens": min(plan.decode.kernel_block_size, plan.prefill.kernel_block_size),
        "decode_ranks": decode_docs,
        "prefill_ranks": [
            {
                "rank": q.rank,
                "consumer_ranks": list(q.consumer_ranks),
                "notifications_per_request": q.notifications_per_request,
                "read_by": list(q.read_by),
                "notify_only_from": list(q.notify_only_from),
            }
            for q in plan.prefill_ranks
        ],
        "post_process": {
            "needed": pp.needed,
            "units_per_block": pp.units_per_block,
            "source_order": pp.source_order.value,
            "target_order": pp.target_order.value,
        },
        "bytes_per_token": {
            "decode_rank": plan.decode.bytes_per_token,
            "all_decode_ranks": plan.decode.bytes_per_token * plan.decode.tp_size,
        },
        "warnings": list(plan.warnings),
    }


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def plan_to_text(plan: TransferPlan) -> str:
    """A readable report of the plan."""
    P, D = plan.prefill, plan.decode
    lines = []
    lines.append(
        f"prefill: TP {P.tp_size}, {P.heads_per_rank} head(s)/rank{' (replicated)' if P.is_replicated else ''}, "
        f"block {P.block_size} tokens, {P.layout.value} {P.head_order.value}"
        f"{', MLA' if P.use_mla else ''}{', Mamba hybrid' if P.mamba else ''}"
    )
    lines.append(
        f"decode:  TP {D.tp_size}, {D.heads_per_rank} head(s)/rank{' (replicated)' if D.is_replicated else ''}, "
        f"block {D.block_size} tokens, {D.layout.value} {D.head_order.value}"
    )
    ratio = "n/a (general interval reads)" if plan.tp_ratio is None else str(plan.tp_ratio)
    lines.append(
        f"model:   {D.num_kv_heads} KV heads x {D.head_dim}, {D.num_layers} layers, {D.dtype}; "
        f"TP ratio {ratio}; block-size ratio (decode/prefill) {plan.decode_over_prefill_block_size}"
    )
    unit = min(P.kernel_block_size, D.kernel_block_size)
    lines.append(
        f"moved:   {_human(D.bytes_per_token)} per token per decode rank, "
        f"{_human(D.bytes_per_token * D.tp_size)} per token in all; "
        f"{_human(D.bytes_per_token * D.block_size)} per decode block per rank"
        + (" (attention KV)" if D.mamba else "")
    )
    if D.mamba is not None:
        state = [plan.mamba_bytes_per_request(p.local_rank) for p in plan.decode_ranks]
        lines.append(
            f"         + Mamba-2 state (conv x/B/C + SSM, one state page per request in each of "
            f"{plan.decode_layout.regions} layer regions): {_human(max(state))} per request per "
            f"decode rank, {_human(sum(state))} per request in all"
        )
    lines.append("")
    element = "packed K+V element" if D.is_packed else "K/V element"
    per_head = [p for p in plan.decode_ranks if p.reads_per_head]
    if per_head:
        lines.append(
            f"decode ranks (local offsets in bytes within one {element} of a {unit}-token unit; "
            f"prefill kernel blocks of {P.kernel_block_size} tokens hold {P.heads_per_rank} heads "
            f"in HND order, so heads are read one by one: prefill offsets are within one "
            f"{P.kernel_block_size}-token {element}, unit u at +u x {per_head[0].remote_unit_stride} B):"
        )
    else:
        lines.append(f"decode ranks (offsets in bytes within one {element} of a {unit}-token unit):")
    for p in plan.decode_ranks:
        reads = ", ".join(
            f"P{r.remote_rank}[{r.remote_offset}:{r.remote_offset + r.length}]->@{r.local_offset}"
            for r in p.reads
        )
        notify = ", ".join(f"P{q}" for q in p.notify_only_ranks) or "-"
        mamba_descs = ""
        if p.mamba is not None:
            mamba_descs = (f" attention + {plan.mamba_descriptors_per_request(p.local_rank)}/request "
                           "Mamba state")
        lines.append(
            f"  D{p.local_rank}: sources {list(p.source_ranks)}  reads {reads}  notify-only {notify}  "
            f"descriptors/block {plan.descriptors_per_block(p.local_rank)}{mamba_descs}"
        )
        if p.mamba is not None:
            m = p.mamba
            pieces = ", ".join(
                f"{x.name} P{x.remote_rank}[{x.remote_offset}:{x.remote_offset + x.length}]->@{x.local_offset}"
                for x in m.mamba_pieces
            )
            lines.append(
                f"       mamba: FA sources {list(m.fa_source_ranks)}, all sources {list(m.all_source_ranks)}, "
                f"{m.num_fa_reads} FA / {m.num_mamba_reads} Mamba reads, FA desc {m.fa_descriptor_bytes} B, "
                f"FA emptied for {list(m.fa_emptied_ranks) or '-'}"
            )
            lines.append(
                f"       mamba state pieces (bytes within one layer's state page, "
                f"{len(m.mamba_pieces)} x {plan.decode_layout.regions} regions = "
                f"{plan.mamba_descriptors_per_request(p.local_rank)} descriptors/request): {pieces}"
            )
    lines.append("")
    lines.append("prefill ranks:")
    for q in plan.prefill_ranks:
        lines.append(
            f"  P{q.rank}: consumers {[f'D{r}' for r in q.consumer_ranks]}  "
            f"notifications/request {q.notifications_per_request}"
            + (f"  (notify-only from {[f'D{r}' for r in q.notify_only_from]})" if q.notify_only_from else "")
        )
    if plan.warnings:
        lines.append("")
        lines.append("warnings:")
        lines.extend(f"  - {w}" for w in plan.warnings)
    return "\n".join(lines) + "\n"


def plan_to_svg(plan: TransferPlan) -> str:
    """An SVG picture: prefill ranks left, decode ranks right, arrows labelled with what moves."""
    P, D = plan.prefill, plan.decode
    row = 46
    rows = max(P.tp_size, D.tp_size)
    height = 90 + rows * row
    width = 760
    lx, rx, box_w, box_h = 40, 560, 160, 30

    def y_of(i: int, n: int) -> float:
        span = rows * row
        return 70 + (i + 0.5) * span / n - box_h / 2

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/>'
        "</marker></defs>",
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
        f"{escape(f'prefill TP {P.tp_size} -> decode TP {D.tp_size}, {D.num_kv_heads} KV heads')}</text>",
        f'<text x="{lx + box_w / 2}" y="52" text-anchor="middle" font-weight="bold">prefill</text>',
        f'<text x="{rx + box_w / 2}" y="52" text-anchor="middle" font-weight="bold">decode</text>',
    ]
    for q in plan.prefill_ranks:
        y = y_of(q.rank, P.tp_size)
        heads = _heads_label(P, q.rank)
        out.append(f'<rect x="{lx}" y="{y:.1f}" width="{box_w}" height="{box_h}" rx="5" '
                   'fill="#e8f0fe" stroke="#3367d6"/>')
        out.append(f'<text x="{lx + 8}" y="{y + 19:.1f}">{escape(f"P{q.rank} {heads}  waits {q.notifications_per_request}")}</text>')
    for p in plan.decode_ranks:
        y = y_of(p.local_rank, D.tp_size)
        out.append(f'<rect x="{rx}" y="{y:.1f}" width="{box_w}" height="{box_h}" rx="5" '
                   'fill="#e6f4ea" stroke="#188038"/>')
        out.append(f'<text x="{rx + 8}" y="{y + 19:.1f}">{escape(f"D{p.local_rank} {_heads_label(D, p.local_rank)}")}</text>')
        for r in p.reads:
            y0 = y_of(r.remote_rank, P.tp_size) + box_h / 2
            y1 = y + box_h / 2
            out.append(f'<line x1="{rx}" y1="{y1:.1f}" x2="{lx + box_w}" y2="{y0:.1f}" stroke="#333" '
                       'marker-end="url(#a)"/>')
            label = f"read {r.length} B @{r.remote_offset}"
            out.append(f'<text x="{(lx + box_w + rx) / 2:.1f}" y="{(y0 + y1) / 2 - 4:.1f}" '
                       f'text-anchor="middle" fill="#333">{escape(label)}</text>')
        for q in p.notify_only_ranks:
            y0 = y_of(q, P.tp_size) + box_h / 2
            y1 = y + box_h / 2
            out.append(f'<line x1="{rx}" y1="{y1:.1f}" x2="{lx + box_w}" y2="{y0:.1f}" stroke="#999" '
                       'stroke-dasharray="5,4" marker-end="url(#a)"/>')
            out.append(f'<text x="{(lx + box_w + rx) / 2:.1f}" y="{(y0 + y1) / 2 + 12:.1f}" '
                       'text-anchor="middle" fill="#999">notify only</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _heads_label(spec, rank: int) -> str:
    if spec.use_mla:
        return "latent"
    h = head_range(spec.tp_size, spec.num_kv_heads, rank)
    return f"h{h.start}" if len(h) == 1 else f"h{h.start}-{h.stop - 1}"
