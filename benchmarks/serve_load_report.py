"""The table and the plot of :mod:`benchmarks.serve_load`'s records (``serve_load --plot a.json ... --png out.png``
runs :func:`plot_main`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(records: list[dict], path: Path) -> bool:
    """Tokens/s (offline and served) and the HTTP overhead against clients, one line per KV scheme, as a PNG.

    False (nothing written) without matplotlib (the ``bench`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kvs = list(dict.fromkeys(r["kv"] for r in records))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, kv in enumerate(kvs):
        color = f"C{i}"
        for kind, style in (("offline", "--"), ("served", "-")):
            rs = sorted((r for r in records if r["kv"] == kv and r["kind"] == kind), key=lambda r: r["clients"])
            left.plot([r["clients"] for r in rs], [r["tokens_per_s"] for r in rs], style, marker="o", color=color,
                      label=f"{kv} {kind}")
        rs = sorted((r for r in records if r["kv"] == kv and r["kind"] == "served"), key=lambda r: r["clients"])
        right.plot([r["clients"] for r in rs], [100 * r["http_overhead"] for r in rs], marker="o", color=color,
                   label=kv)
    right.axhline(10, color="k", lw=0.8, ls=":", label="goal at 64 clients")
    for ax, ylabel in ((left, "output tokens / s"), (right, "HTTP overhead, % of offline tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    fig.suptitle("kvgen serve vs the same engine offline (best of each path's runs)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_main(files: list[str], png: str) -> int:
    """``--plot``: the table and the PNG of the records of one or more result files (later files win a tie)."""
    merged: dict[tuple, dict] = {}
    for name in files:
        for r in json.loads(Path(name).read_text())["records"]:
            merged[(r["kv"], r["clients"], r["kind"])] = r
    records = list(merged.values())
    print(table(records))
    if not plot(records, Path(png)):
        print("no plot: matplotlib is missing (pip install 'kvgen[bench]')", file=sys.stderr)
        return 1
    print(f"wrote {png}", file=sys.stderr)
    return 0


def table(records: list[dict]) -> str:
    rows = [f"{'kv':>5} {'C':>4} {'path':>8} {'req/s':>8} {'tok/s':>9} {'TTFT p50/p99 ms':>17} "
            f"{'TPOT p50/p99 ms':>17} {'overhead':>8}"]
    for r in records:
        over = f"{100 * r['http_overhead']:7.1f}%" if "http_overhead" in r else ""
        if "http_overhead_median" in r:
            over += f" (median {100 * r['http_overhead_median']:.1f}%)"
        if "http_overhead_paired" in r:
            over += f" (paired {100 * r['http_overhead_paired']:.1f}%)"
        if r.get("failed"):
            over += f" FAILED {r['failed']}"
        rows.append(f"{r['kv']:>5} {r['clients']:>4} {r['kind']:>8} {r['requests_per_s']:8.2f} {r['tokens_per_s']:9.0f}"
                    f" {r['ttft_p50_ms'] or 0:8.1f}/{r['ttft_p99_ms'] or 0:8.1f} "
                    f"{r['tpot_p50_ms'] or 0:8.1f}/{r['tpot_p99_ms'] or 0:8.1f} {over:>8}")
    return "\n".join(rows)
