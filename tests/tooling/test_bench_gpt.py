"""bench/bench_gpt.py without a GPU: its options, the shared initial weights and batches, the loss table's
reference and relative differences, and a whole run's JSON and text with the variants stubbed (the variants
themselves need CUDA: run the script on a GPU)."""

import json

import numpy as np
import pytest
from helpers.bench import load_bench_script


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("bench_gpt", "bench_gpt.py")


def test_options(bench, tmp_path):
    out = str(tmp_path / "r.json")
    full = bench.parse(["--out", out])
    assert (full.layers, full.width, full.heads, full.context, full.batch, full.vocab) == (12, 768, 12, 1024, 8, 50304)
    assert (full.steps, full.warmup, full.log_every, full.lr_warmup) == (200, 20, 10, 20)
    assert full.variants == list(bench.VARIANTS)
    quick = bench.parse(["--out", out, "--quick", "--layers", "3", "--no-compile"])
    assert (quick.layers, quick.width, quick.steps, quick.log_every) == (3, 128, 30, 5)
    assert "torch-compile" not in quick.variants
    for argv in (["--variants", "ours-eager,ours-fast"], ["--quick", "--warmup", "30"]):
        with pytest.raises(SystemExit):
            bench.parse(["--out", out, *argv])


def test_every_variant_gets_the_same_weights_and_batches(bench, tmp_path):
    args = bench.parse(["--out", str(tmp_path / "r.json"), "--quick", "--steps", "7", "--warmup", "2"])
    config, initial, batches = bench.setup(args)
    again = bench.setup(args)
    assert config.vocab == 512 and len(batches) == 7
    for (x, y), (x2, y2) in zip(batches, again[2]):
        assert x.dtype == np.int32 and x.flags.c_contiguous and x.shape == (args.batch, args.context)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        np.testing.assert_array_equal(x, x2)
    for name, value in initial.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, again[1][name])
    with pytest.raises(ValueError, match="too small"):
        bench.setup(bench.parse(["--out", str(tmp_path / "r.json"), "--quick", "--vocab", "50"]))


def _result(losses, ms):
    return dict(step_ms=ms, tokens_per_s=1e6 / ms, wall_ms=ms, first_step_s=1.0, peak_bytes=2**30,
                reserved_bytes=2**31, losses=losses, all_step_ms=[ms] * len(losses))  # fmt: skip


def test_loss_table_against_the_reference(bench):
    results = {
        "ours-eager": _result([4.0, 3.0, 2.0, 1.5, 1.0], 10.0),
        "torch-eager": _result([4.0, 3.0, 2.1, 1.5, 1.0], 12.0),
        "ours-graph": dict(error="Traceback ...\nRuntimeError: capture failed"),
    }
    rows = bench.curve_rows(results, steps=5, every=2)
    assert [r["step"] for r in rows] == [2, 4, 5]
    assert all(r["reference"] == "torch-eager" for r in rows)
    assert rows[0]["max_rel_diff"] == 0.0
    rows_all = bench.curve_rows(results, steps=5, every=1)
    assert rows_all[2]["max_rel_diff"] == pytest.approx(0.1 / 2.1)
    text = bench.tables(results, rows)
    assert text.splitlines()[-1].startswith("| ours-graph | RuntimeError: capture failed")
    assert "| ours-eager | 10.00 | 100,000 |" in text


def test_a_whole_run_writes_json_and_text(bench, tmp_path, monkeypatch):
    def fake(name, args, config, initial, batches):
        if name == "ours-plain":
            raise RuntimeError("stubbed failure")
        return _result([5.0 - 0.1 * i for i in range(args.steps)], 3.0)

    monkeypatch.setattr(bench, "run_ours", fake)
    monkeypatch.setattr(bench, "run_torch", fake)
    monkeypatch.setattr(bench, "release_memory", lambda: None)
    out = tmp_path / "log" / "r.json"
    results = bench.main(["--out", str(out), "--quick", "--steps", "12", "--warmup", "2"])
    saved = json.loads(out.read_text())
    assert set(saved) == {"environment", "config", "results", "curve"}
    assert "stubbed failure" in saved["results"]["ours-plain"]["error"]
    assert [r["step"] for r in saved["curve"]] == [5, 10, 12]
    assert out.with_suffix(".txt").read_text().rstrip().endswith(bench.tables(results, saved["curve"]).rstrip())
