"""bench/plot.py on a synthetic bench_attention.py JSON: the series it reads (no matplotlib needed), the
PNGs it draws (skipped without matplotlib), and its one-line message when matplotlib is missing."""

import json
import sys

import pytest
from helpers.bench import load_bench_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plot():
    return load_bench_script("bench_plot", "plot.py")  # (this also proves it imports without matplotlib)


def _case(dtype, d, n, causal, fwd, bwd):
    b, h = 16384 // n, 2048 // d
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    return {
        "case": f"{dtype}-d{d}-{'causal' if causal else 'full'}-n{n}",
        "dtype": dtype,
        "d": d,
        "n": n,
        "causal": causal,
        "b": b,
        "h": h,
        "flops_fwd": flops,
        "flops_bwd": 2.5 * flops,
        "fwd": fwd,
        "bwd": bwd,
    }


def _ok(tflops):
    return {"status": "ok", "tflops": tflops, "ms": 1.0, "error_vs_fp64": 1e-3}


@pytest.fixture
def results_json(tmp_path):
    cases = []
    for n, t in ((2048, 100.0), (512, 60.0), (8192, 150.0)):  # out of order on purpose
        cases.append(
            _case(
                "bf16",
                128,
                n,
                False,
                {"ours": _ok(t), "flash": _ok(t + 10), "naive": {"status": "skip"}},
                {"ours": _ok(t / 2), "flash": {"status": "bad", "error_vs_fp64": 1.0}},
            )
        )
    cases.append(_case("fp16", 64, 1024, True, {"ours": _ok(80.0), "cudnn": {"status": "OOM"}}, {"ours": _ok(40.0)}))
    memory = [
        {
            "n": 4096,
            "min_fwd_mib": 16.1,
            "min_bwd_mib": 48.0,
            "ours_fwd_mib": 16.1,
            "ours_bwd_mib": 60.0,
            "naive_fwd_mib": 512.0,
            "naive_bwd_mib": 1536.0,
        },
        {
            "n": 8192,
            "min_fwd_mib": 32.3,
            "min_bwd_mib": 96.0,
            "ours_fwd_mib": 32.3,
            "ours_bwd_mib": 120.0,
            "naive_fwd_mib": "OOM",
            "naive_bwd_mib": "n/a (RuntimeError)",
        },
    ]
    results = {
        "environment": {"device": "Test GPU (compute capability 9.0, 132 SMs)"},
        "cases": cases,
        "memory": memory,
        "memory_case": {"dtype": "fp16", "heads": 16, "head_dim": 128, "causal": True},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(results))
    return path


def test_speed_series_groups_timed_points_by_dtype_head_dim_and_causal(plot, results_json):
    groups = plot.speed_series(plot.load(results_json))
    assert set(groups) == {("bf16", 128, False), ("fp16", 64, True)}
    bf16 = groups["bf16", 128, False]
    assert bf16["fwd"] == {
        "ours": [(512, 60.0), (2048, 100.0), (8192, 150.0)],
        "flash": [(512, 70.0), (2048, 110.0), (8192, 160.0)],
    }  # sorted by N; skip is no point
    assert bf16["bwd"] == {"ours": [(512, 30.0), (2048, 50.0), (8192, 75.0)]}  # "bad" is no point
    assert groups["fp16", 64, True]["fwd"] == {"ours": [(1024, 80.0)]}  # OOM is no point


def test_memory_series_keeps_numbers_only(plot, results_json):
    memory = plot.memory_series(plot.load(results_json))
    assert memory["fwd"] == {
        "min": [(4096, 16.1), (8192, 32.3)],
        "ours": [(4096, 16.1), (8192, 32.3)],
        "naive": [(4096, 512.0)],
    }
    assert memory["bwd"]["naive"] == [(4096, 1536.0)]


def test_figure_names(plot, results_json):
    assert plot.figure_name(results_json, ("bf16", 128, True)) == "bench-bf16-d128-causal.png"
    assert plot.figure_name(results_json, ("fp32", 64, False)) == "bench-fp32-d64-full.png"


def test_plot_writes_pngs_next_to_the_json(plot, results_json):
    pytest.importorskip("matplotlib")
    paths = plot.plot(results_json)
    names = sorted(p.name for p in paths)
    assert names == ["bench-bf16-d128-full.png", "bench-fp16-d64-causal.png", "bench-memory.png"]
    for path in paths:
        assert path.parent == results_json.parent and path.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_speed_or_memory_writes_nothing(plot, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "cold.json"
    path.write_text(json.dumps({"environment": {}, "cold_start": {}}))
    assert plot.plot(path) == []


def test_missing_matplotlib_is_a_one_line_message(plot, results_json, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="plotting needs matplotlib"):
        plot.plot(results_json)
    assert plot.main([str(results_json)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("plotting needs matplotlib") and err.count("\n") == 1
    assert not list(results_json.parent.glob("*.png"))


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("cupy")  # bench_attention.py imports CuPy (it touches no GPU here)
    return load_bench_script("bench_attention", "bench_attention.py")


def test_bench_plot_flag_needs_json(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot"])
    assert "--plot draws the --json file" in capsys.readouterr().err
    assert bench.parse_args(["--plot", "--json", "x.json"]).plot


def test_bench_plot_flag_skips_in_one_line_without_matplotlib(bench, results_json, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    bench.draw_plots(str(results_json))
    out = capsys.readouterr().out
    assert out.startswith("--plot skipped: plotting needs matplotlib") and out.count("\n") == 1


def test_bench_timing_flag(bench):
    assert bench.parse_args([]).timing == "call"
    assert bench.parse_args(["--timing", "gpu"]).timing == "gpu"
    with pytest.raises(SystemExit):
        bench.parse_args(["--timing", "host"])
