#!/usr/bin/env python3
"""Plot bench_serving.py's figures: TTFT p50/p99, ITL p50 and output tokens/s per request rate.

    uv run --frozen --with matplotlib python bench/plot_serving.py /tmp/serving.json [more.json ...] \
        docs/serving-bench.png

Several JSON files (e.g. one per setup, from separate runs) are drawn together; a setup
that appears in more than one keeps its last figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {"pull": "kvbridge P/D pull", "push": "kvbridge P/D push", "nixl": "NixlConnector P/D",
          "single": "one engine alone"}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups: dict[str, list[dict]] = {}
    titles = []
    for path in argv[:-1]:
        data = json.loads(Path(path).read_text())
        titles.append(f"{data['meta']['started']}, load {data['meta']['load_start']}")
        for res in data["results"]:
            if res.get("rates"):
                setups[res["setup"]] = res["rates"]
    panels = (("median_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
              ("median_itl_ms", "inter-token latency p50 (ms)"), ("output_throughput", "output tokens/s"))
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, rows in setups.items():
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", label=LABELS.get(name, name))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if key.endswith("ttft_ms"):  # NixlConnector's stalls reach seconds, kvbridge's tens of ms
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("vllm bench serve through kvbridge router (tiny Llama, 2 cores); " + "; ".join(titles),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(argv[-1], dpi=90)
    print(f"wrote {argv[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
