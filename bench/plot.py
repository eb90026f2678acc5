#!/usr/bin/env python3
"""Plots of the JSON that ``bench_attention.py --json`` writes: TFLOP/s and peak memory against N.

    python bench/plot.py results.json                         # PNGs next to results.json
    python bench/bench_attention.py --cases 'bf16' --json results.json --plot

One PNG per (dtype, head dim, causal) group of speed cases, forward and backward side by side, one line
per backend (ours and each peer; points that were not timed, OOM or "bad", are left out):
``<stem>-<dtype>-d<D>-<causal|full>.png``; and per dtype with several head dims, a summary of them all
(forward above, backward below, a column per head dim, full attention solid and causal dashed):
``<stem>-<dtype>-summary.png`` (the README's figure). With a memory table (``--memory``), ``<stem>-memory.png``:
extra peak MiB against N, forward and backward, with ours' minimum dashed. Drawing needs matplotlib (the
``bench`` extra); reading the JSON needs neither matplotlib nor CuPy, so this module imports anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PHASES = (("fwd", "forward"), ("bwd", "backward"))
# bench_attention.BACKENDS, in its order, so that every plot gives a backend the same colour.
BACKENDS = ("ours", "flash", "cudnn", "efficient", "naive")
MIN_SERIES = "min"  # the memory table's lower bound (outputs only), drawn dashed
FIGURE_SIZE = (11, 4.2)  # inches: two panels side by side
DPI = 120


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def speed_series(results: dict) -> dict[tuple, dict[str, dict]]:
    """{(dtype, d, causal): {"fwd": {backend: [(n, tflops), ...]}, "bwd": {...}}} over the timed points."""
    groups: dict = {}
    for case in results.get("cases", []):
        group = groups.setdefault((case["dtype"], case["d"], case["causal"]), {phase: {} for phase, _ in PHASES})
        for phase, _ in PHASES:
            for backend, entry in case.get(phase, {}).items():
                if entry.get("status") == "ok":
                    group[phase].setdefault(backend, []).append((case["n"], entry["tflops"]))
    for group in groups.values():
        for series in group.values():
            for points in series.values():
                points.sort()
    return groups


def memory_series(results: dict) -> dict[str, dict]:
    """{"fwd": {name: [(n, MiB), ...]}, "bwd": {...}} from the rows' ``<name>_<phase>_mib`` numbers."""
    series: dict = {phase: {} for phase, _ in PHASES}
    for row in results.get("memory", []):
        for key, value in row.items():
            if not key.endswith("_mib") or not isinstance(value, (int, float)):  # "OOM", "n/a": no point
                continue
            name, _, phase = key[: -len("_mib")].rpartition("_")
            if phase in series:
                series[phase].setdefault(name, []).append((row["n"], value))
    for by_name in series.values():
        for points in by_name.values():
            points.sort()
    return series


def summary_groups(groups: dict) -> dict[str, list[int]]:
    """{dtype: its head dims} for the dtypes timed at two head dims or more (the summary figures)."""
    dims: dict = {}
    for dtype, d, _ in groups:
        dims.setdefault(dtype, set()).add(d)
    return {dtype: sorted(ds) for dtype, ds in dims.items() if len(ds) > 1}


def figure_name(json_path: Path, group: tuple) -> str:
    dtype, d, causal = group
    return f"{json_path.stem}-{dtype}-d{d}-{'causal' if causal else 'full'}.png"


# ---------------------------------------------------------------------------------------------------------
# Drawing (matplotlib)


def plot(json_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw every figure of one JSON file; returns the PNGs written (next to the JSON by default).
    Raises ImportError with a one-line message when matplotlib is missing."""
    Figure = _figure_class()
    json_path = Path(json_path)
    out_dir = json_path.parent if out_dir is None else Path(out_dir)
    results = load(json_path)
    device = results.get("environment", {}).get("device", "").split(" (")[0]  # the name, not its SM count
    written = []
    for group, phases in sorted(speed_series(results).items()):
        path = out_dir / figure_name(json_path, group)
        _draw_speed(Figure(figsize=FIGURE_SIZE), group, phases, results, device).savefig(path, dpi=DPI)
        written.append(path)
    groups = speed_series(results)
    for dtype, dims in sorted(summary_groups(groups).items()):
        path = out_dir / f"{json_path.stem}-{dtype}-summary.png"
        fig = Figure(figsize=(4.2 * len(dims), 7.5))
        _draw_summary(fig, dtype, dims, groups, results, device).savefig(path, dpi=DPI)
        written.append(path)
    memory = memory_series(results)
    if any(memory.values()):
        path = out_dir / f"{json_path.stem}-memory.png"
        _draw_memory(Figure(figsize=FIGURE_SIZE), memory, results, device).savefig(path, dpi=DPI)
        written.append(path)
    return written


def _figure_class():
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no GUI backend, no global state
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib (pip install matplotlib, or the bench extra): {exc}") from exc
    return Figure


def _draw_speed(fig, group, phases, results, device):
    dtype, d, causal = group
    fig.suptitle(f"{dtype}, D = {d}, {'causal' if causal else 'not causal'}" + (f", {device}" if device else ""))
    case = next(c for c in results["cases"] if (c["dtype"], c["d"], c["causal"]) == group)
    tokens = case["b"] * case["n"]
    for ax, (phase, title) in zip(fig.subplots(1, 2), PHASES):
        for backend, points in _ordered(phases[phase]):
            n, tflops = zip(*points)
            ax.plot(n, tflops, marker="o", label=backend, color=_colour(backend))
        _axes(ax, title, f"N (B x N = {tokens} tokens, H = {case['h']})", "TFLOP/s")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def _draw_summary(fig, dtype, dims, groups, results, device):
    date = results.get("environment", {}).get("date", "").split(" ")[0]
    fig.suptitle(
        f"{dtype} attention, TFLOP/s against N" + (f", {device}" if device else "") + (f", {date}" if date else "")
    )
    axes = fig.subplots(2, len(dims), squeeze=False)
    for column, d in enumerate(dims):
        for row, (phase, title) in enumerate(PHASES):
            ax = axes[row][column]
            for causal in (False, True):
                for backend, points in _ordered(groups.get((dtype, d, causal), {}).get(phase, {})):
                    n, tflops = zip(*points)
                    ax.plot(
                        n,
                        tflops,
                        marker="o",
                        markersize=3,
                        linestyle="--" if causal else "-",
                        color=_colour(backend),
                        label=f"{backend}{' causal' if causal else ''}",
                    )
            _axes(ax, f"{title}, D = {d}", "N", "TFLOP/s")
            ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def _draw_memory(fig, memory, results, device):
    case = results.get("memory_case")  # absent from JSON written before bench_attention.py saved it
    what = (
        f"{case['dtype']}, B = 1, H = {case['heads']}, D = {case['head_dim']}, "
        f"{'causal' if case['causal'] else 'not causal'}"
        if case
        else ""
    )
    details = ", ".join(filter(None, (what, device)))
    fig.suptitle("extra peak memory beyond the inputs" + (f"\n{details}" if details else ""))
    for ax, (phase, title) in zip(fig.subplots(1, 2), PHASES):
        for name, points in _ordered(memory[phase]):
            n, mib = zip(*points)
            dashed = name == MIN_SERIES
            ax.plot(
                n,
                mib,
                marker="" if dashed else "o",
                linestyle="--" if dashed else "-",
                color="grey" if dashed else _colour(name),
                label="minimum (outputs)" if dashed else name,
            )
        _axes(ax, title, "N", "MiB")
        ax.set_yscale("log")
    fig.tight_layout()
    return fig


def _ordered(series: dict):
    """Known backends in BACKENDS order first, then any other name, alphabetically."""
    rank = {name: i for i, name in enumerate(BACKENDS)}
    return sorted(series.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0]))


def _colour(name: str) -> str:
    # Matplotlib's default cycle, fixed per backend so that "ours" has one colour in every figure.
    cycle = ("C0", "C1", "C2", "C3", "C4")
    return cycle[BACKENDS.index(name)] if name in BACKENDS else "C5"


def _axes(ax, title, xlabel, ylabel):
    ax.set_title(title)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="a file written by bench_attention.py --json")
    parser.add_argument("--out-dir", help="where to write the PNGs (default: next to the JSON)")
    args = parser.parse_args(argv)
    try:
        paths = plot(args.json, args.out_dir)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    if not paths:
        print(f"{args.json} has no timed cases and no memory table: nothing to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
