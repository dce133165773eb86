"""Descriptor building: kvbridge.memory (numpy) vs a per-block Python tuple loop.

70B-class geometry by default: 80 layers, kv-first (separate K and V regions,
160 regions), 8 KV heads x 128 dims bf16, 16-token blocks, 100k blocks per
region, prefill TP 8 -> decode TP 2. For decode rank 0 it builds, for every
prefill rank it reads, the remote prepared list and the local split list as
N x 3 (address, length, device) arrays, both ways, checks they are equal, and
prints the times, the ratio, and the strided N x 5 row counts.

    uv run python bench/bench_descriptors.py [--blocks 100000] [--layers 80]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kvbridge.memory import RegionGeometry, kernel_spec, rank_descriptors
from kvbridge.topology import EngineSpec, plan_rank


def geometry(spec: EngineSpec, num_blocks: int, base: int) -> RegionGeometry:
    blen = kernel_spec(spec).region_block_bytes
    regions = 2 * spec.num_layers
    gap = num_blocks * blen + 4096
    return RegionGeometry.from_remote(spec, [base + i * gap for i in range(regions)], num_blocks,
                                      blen, device_id=0, mem_type="VRAM")


def python_loop(geo: RegionGeometry, unit_bytes: int, reads, offset_attr: str) -> list[list[tuple]]:
    """The baseline: one tuple per (region, element, read, block), region by region."""
    out = []
    for base, stride in zip(geo.base_addrs, geo.block_strides, strict=True):
        for eoff in geo.element_offsets:
            for r in reads:
                start = base + eoff + getattr(r, offset_attr)
                region = []
                for b in range(geo.num_blocks):
                    region.append((start + b * stride, r.length, geo.device_id))
                out.append(region)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--prefill-tp", type=int, default=8)
    ap.add_argument("--decode-tp", type=int, default=2)
    args = ap.parse_args()

    common = dict(num_kv_heads=8, head_dim=128, num_layers=args.layers, block_size=16, dtype="bf16")
    prefill = EngineSpec(engine_id="prefill", tp_size=args.prefill_tp, **common)
    decode = EngineSpec(engine_id="decode", tp_size=args.decode_tp, **common)
    plan = plan_rank(decode, prefill, 0)
    local = geometry(decode, args.blocks, 0x7F00_0000_0000)
    remotes = {q: geometry(prefill, args.blocks, 0x7E00_0000_0000 + q * (1 << 40))
               for q in range(args.prefill_tp)}
    print(f"geometry: {args.layers} layers x K/V = {local.num_regions} regions, {args.blocks} blocks, "
          f"TP {args.prefill_tp} -> {args.decode_tp}; decode rank 0 reads prefill ranks "
          f"{list(plan.source_ranks)}")

    t_cold = t_np = t_py = 0.0
    total = 0
    strided_rows = 0
    for q in plan.source_ranks:
        reads = plan.reads_from(q)
        # cold: the first build of a list also pays for the OS handing out fresh pages
        t0 = time.perf_counter()
        rd = rank_descriptors(plan, q, local, remotes[q])
        remote_np = rd.remote_descs()
        local_np = rd.local_descs()
        t_cold += time.perf_counter() - t0
        del remote_np, local_np
        # warm: the same build again, into memory the process already holds
        t0 = time.perf_counter()
        rd = rank_descriptors(plan, q, local, remotes[q])
        remote_np = rd.remote_descs()
        local_np = rd.local_descs()
        t_np += time.perf_counter() - t0
        strided_rows += len(rd.remote_rows) + len(rd.local_rows)

        for side, geo, arr, attr in (("remote", remotes[q], remote_np, "remote_offset"),
                                     ("local", local, local_np, "local_offset")):
            t0 = time.perf_counter()
            lists = python_loop(geo, 0, reads, attr)
            t_py += time.perf_counter() - t0
            # equality, outside the timed part; one region list at a time
            n = geo.num_blocks
            for i, region in enumerate(lists):
                ref = np.array(region, dtype=np.uint64)
                if not np.array_equal(ref, arr[i * n:(i + 1) * n]):
                    raise SystemExit(f"MISMATCH: {side} list of prefill rank {q}, row {i}")
            total += len(arr)
            del lists
        del remote_np, local_np

    print(f"descriptors built: {total:,} (local + remote, N x 3), identical both ways")
    print(f"python per-block tuple loop: {t_py:8.3f} s")
    print(f"kvbridge.memory (numpy), first build (fresh pages): {t_cold:8.3f} s "
          f"-> {t_py / t_cold:.0f}x")
    print(f"kvbridge.memory (numpy), rebuild (warm memory):     {t_np:8.3f} s "
          f"-> {t_py / t_np:.0f}x (target >= 100x)")
    t0 = time.perf_counter()
    rows = [rank_descriptors(plan, q, local, remotes[q]) for q in plan.source_ranks]
    t_rows = time.perf_counter() - t0
    print(f"strided N x 5 form: {strided_rows} rows in all ({strided_rows // (2 * len(rows))} per list "
          f"= regions x reads x units) for {total:,} descriptors; built in {t_rows * 1e3:.2f} ms")
    print(f"speed-up, strided N x 5 (what NIXL >= 1.5 prepares): {t_py / t_rows:,.0f}x")


if __name__ == "__main__":
    main()
