#!/usr/bin/env python3
"""Ring attention's speedup over one GPU against N, from the JSON that ``bench_ring.py --json`` writes.

    python bench/plot_ring.py                              # every bench/log/*ring*.json -> bench/log/ring_speedup.svg
    python bench/plot_ring.py a.json b.json --out ring.svg

One line per ring size W and device: the forward + backward speedup of the causal zigzag rows, against N on a
log2 axis (labels 128k, 1M), each point marked with its value; a dashed line at y = W for each W, the ideal.
Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LOG = Path(__file__).resolve().parent / "log"


def series(paths) -> dict[tuple[int, str], list[tuple[int, float]]]:
    """{(W, device): [(N, fwd+bwd speedup), ...]} over the causal zigzag rows, N increasing."""
    lines: dict = {}
    for path in paths:
        log = json.loads(Path(path).read_text())
        for row in log.get("speed", []):
            if row["causal"] and row["layout"] == "zigzag":
                lines.setdefault((row["W"], log["device"]), []).append((row["N"], row["speedup_fwd_bwd"]))
    return {key: sorted(points) for key, points in sorted(lines.items())}


def size_label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k"


def plot(paths, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "plot_ring"  # the same SVG for the same logs
    from matplotlib import pyplot as plt

    lines = series(paths)
    if not lines:
        raise SystemExit("no causal zigzag rows in " + ", ".join(map(str, paths)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {w: f"C{i}" for i, w in enumerate(sorted({w for w, _ in lines}))}
    for w, colour in colours.items():
        ax.axhline(w, color=colour, linestyle="--", linewidth=1, alpha=0.7)
    for (w, device), points in lines.items():
        ns, speedups = zip(*points)
        ax.plot(ns, speedups, "o-", color=colours[w], label=f"W = {w}, {device}")
        for n, s in points:
            ax.annotate(f"{s:.2f}", (n, s), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    ns = sorted({n for points in lines.values() for n, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [size_label(n) for n in ns])
    ax.minorticks_off()
    ax.set_ylim(0, max(colours) + 0.5)
    ax.set_xlabel("N (rows in the whole sequence)")
    ax.set_ylabel("speedup over one GPU, fwd + bwd")
    ax.set_title("Ring attention, causal zigzag, bf16 (dashed: y = W)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="*", help="bench_ring.py logs (default: bench/log/*ring*.json)")
    parser.add_argument("--out", type=Path, default=LOG / "ring_speedup.svg")
    args = parser.parse_args(argv)
    paths = args.json or sorted(LOG.glob("*ring*.json"))
    plot(paths, args.out)
    print(f"wrote {args.out} from {len(paths)} logs")


if __name__ == "__main__":
    main()
