"""bench/sanitize.py without a GPU: the variants' labels, which variants a device reaches, that the calls the worker
makes select exactly their variant, and the FP8 forward's calls (through the CPU path, CuPy's transfers replaced
by NumPy's). Under the sanitizer on a GPU: ``python bench/sanitize.py``."""

import dataclasses
import re

import numpy as np
import pytest
from helpers.bench import load_bench_script

import cupyflash
from cupyflash._cuda import fp8 as gpu_fp8
from cupyflash._cuda import tile_policy, tiles
from cupyflash._cuda.variants import FP8, FP8_OUT_DTYPES, Device, Variant

HOPPER = Device(wgmma=True, large_smem=True)
AMPERE = Device()
LARGE_SMEM_ONLY = Device(large_smem=True)  # compute capability > 9.0, or Hopper with CUPYFLASH_NO_WGMMA=1
SHIPPED = tile_policy.shipped_variants()
FP8_SHIPPED = [v for v in SHIPPED if v.dtype == FP8]


@pytest.fixture(scope="module")
def sanitize():
    return load_bench_script("sanitize", "sanitize.py")


def test_every_shipped_variant_has_its_own_label(sanitize):
    labels = [sanitize.variant_label(v) for v in SHIPPED]
    assert len(set(labels)) == len(SHIPPED)
    pattern = r"(fwd|bwd|probs)/(fp16|bf16|fp32|fp64|fp8)/\d+/(mma|large|wgmma|pieces|ws)/[a-z0-9_/-]+"
    assert [label for label in labels if not re.fullmatch(pattern, label)] == []


def test_fp8_variants_are_labelled_with_their_out_dtype(sanitize):
    out_names = {"bfloat16": "bf16", "float16": "fp16"}
    expected = {
        f"fwd/fp8/{d}/ws/{'causal' if causal else 'plain'}/out-{out_names[out]}"
        for d in tiles.FP8_HEAD_DIMS
        for causal in (False, True)
        for out in FP8_OUT_DTYPES
    }
    assert len(FP8_SHIPPED) == len(expected) == 4 * len(tiles.FP8_HEAD_DIMS)
    assert {sanitize.variant_label(v) for v in FP8_SHIPPED} == expected
    assert sanitize.variant_label(tile_policy.fp8(128, True, "float16")) == "fwd/fp8/128/ws/causal/out-fp16"
    # --variants picks them out by dtype and by out dtype, and nothing else but the unrounded results (out-fp32)
    # has an out dtype in its name.
    labels = [sanitize.variant_label(v) for v in SHIPPED]
    assert {label for label in labels if re.search("^fwd/fp8/", label)} == expected
    assert len([label for label in labels if re.search("/out-fp16$", label)]) == 2 * len(tiles.FP8_HEAD_DIMS)
    assert not [label for v, label in zip(SHIPPED, labels) if v.dtype != FP8 and "out-" in label and not v.wide]
    assert all(label.endswith("/out-fp32") for v, label in zip(SHIPPED, labels) if v.wide)


@pytest.mark.parametrize(
    "variant, label",
    [
        (Variant("fwd", "float16", 64, "mma"), "fwd/fp16/64/mma/plain"),
        (Variant("bwd", "bfloat16", 128, "wgmma", causal=True, dropout=True), "bwd/bf16/128/wgmma/causal/dropout"),
        (Variant("bwd", "bfloat16", 128, "wgmma", mods="softcap", causal=True), "bwd/bf16/128/wgmma/softcap-causal"),
        (
            Variant("fwd", "bfloat16", 128, "ws", mods="scalars", score="alibi", block_mask=True),
            "fwd/bf16/128/ws/scalars/alibi/block-mask",
        ),
        (Variant("bwd", "float16", 64, "ws", causal=True, deterministic=False), "bwd/fp16/64/ws/causal/unordered"),
        (Variant("probs", "float64", 32, "large", mods="all"), "probs/fp64/32/large/all"),
    ],
)
def test_labels_of_the_other_variants_stay_as_they_were(sanitize, variant, label):
    assert sanitize.variant_label(variant) == label


def test_fp8_variants_are_reached_on_hopper_alone(sanitize):
    for variant in FP8_SHIPPED:
        assert sanitize.reachable(variant, HOPPER), sanitize.variant_label(variant)
        assert not sanitize.reachable(variant, AMPERE)
        assert not sanitize.reachable(variant, LARGE_SMEM_ONLY)


def test_fp8_calls_select_exactly_their_variant(sanitize):
    for variant in FP8_SHIPPED:
        calls = sanitize._calls(variant, None, None)
        assert calls and not sanitize._packed_options(variant)
        for causal, options in calls:
            assert causal == variant.causal and set(options) == {"out_dtype"}
            assert np.dtype(options["out_dtype"]).name == variant.out_dtype
            for tma in (True, False):
                assert sanitize._selected(variant, causal, options, HOPPER, tma=tma) == variant
            # The head dims the FP8 forward rounds up to pick the same tiles.
            smaller = dataclasses.replace(variant, head_dim=variant.head_dim - 16)
            assert sanitize._selected(smaller, causal, options, HOPPER) == variant
            assert sanitize._selected(variant, causal, options, AMPERE) is None
            assert sanitize._selected(variant, causal, options, HOPPER, packed=True) is None
            assert sanitize._selected(variant, causal, dict(options, softcap=5.0), HOPPER) is None


def test_16_bit_warp_specialized_forwards_still_select_their_own(sanitize):
    """The FP8 forward shares their path and head dims; its own selection leaves theirs alone."""
    for variant in FP8_SHIPPED:
        half = Variant("fwd", variant.out_dtype, variant.head_dim, "ws", causal=variant.causal)
        if half in SHIPPED:
            assert sanitize._selected(half, variant.causal, {}, HOPPER) == half
            assert sanitize.variant_label(half) != sanitize.variant_label(variant)


def test_unrounded_variants_are_reached_and_ask_for_float32_results(sanitize):
    """Every variant with unrounded results (out-fp32) is reached on the device its path runs on, and the worker's
    calls ask for float32 out (forward) or gradients (backward) alone."""
    wide = [v for v in SHIPPED if v.wide]
    assert len(wide) == 208
    for variant in wide:
        device = HOPPER if variant.path in ("wgmma", "ws") else AMPERE
        assert sanitize.reachable(variant, device), sanitize.variant_label(variant)
        rounded = dataclasses.replace(variant, out_dtype="")
        assert not any(
            sanitize._selected(rounded, causal, options, device) == variant
            for causal, options in sanitize._calls(variant, None, None)
        ), "a call without out_dtype or grad_dtype never takes an unrounded variant"
        options = sanitize._wide_options(variant)
        other = "bwd" if variant.direction == "fwd" else "fwd"
        assert options[other] == {} and options[variant.direction] == (
            dict(out_dtype="float32") if variant.direction == "fwd" else dict(grad_dtype="float32")
        )


class _Recorded(Exception):
    pass


def test_fp8_worker_calls_run_the_forward_alone_with_per_slice_then_block_scales(sanitize, monkeypatch):
    """_run_fp8's calls through the public API: per-slice descales on the plain shapes, then blocks of 128 rows
    on longer ones; never a backward. CuPy's transfers become NumPy's, so the CPU path runs the calls."""
    cupy = pytest.importorskip("cupy")
    calls = []
    forward = cupyflash.attention_forward

    def recorded_forward(q, k, v, **options):
        out, lse = forward(q, k, v, **options)
        calls.append((q, k, v, options, out, lse))
        return out, lse

    def no_backward(*args, **options):
        raise _Recorded("attention_backward called for an FP8 variant")

    class HostDevice:
        def synchronize(self):
            pass

    monkeypatch.setattr(cupyflash, "attention_forward", recorded_forward)
    monkeypatch.setattr(cupyflash, "attention_backward", no_backward)
    monkeypatch.setattr(cupy, "asarray", np.asarray)
    monkeypatch.setattr(cupy.cuda, "Device", HostDevice)
    rng = np.random.default_rng(0)
    for variant in [tile_policy.fp8(64, False, "bfloat16"), tile_policy.fp8(128, True, "float16")]:
        calls.clear()
        sanitize._run_fp8(variant, rng, HOPPER)
        assert len(calls) == len(sanitize.FP8_CALLS) == 2
        (plain, blocks) = calls
        for (q, k, v, options, out, lse), (shape, block) in zip(calls, sanitize.FP8_CALLS):
            assert options["causal"] == variant.causal and out.dtype.name == variant.out_dtype
            assert q.shape == shape["batch"] + (shape["nq"], variant.head_dim)
            assert k.shape == v.shape == shape["batch"] + (shape["nk"], variant.head_dim)
            assert out.shape == q.shape and lse.shape == q.shape[:-1] and bool(np.isfinite(lse).all())
        # One descale per slice, then several per slice: q's rows in 2 blocks of 128, k's and v's in 3.
        q, k, v = plain[:3]
        assert q.scale.shape == (2, 1) and k.scale.shape == v.scale.shape == (2, 1)
        q, k, v = blocks[:3]
        assert q.block == k.block == v.block == 128
        assert q.scale.shape == (1, 2, 2) and k.scale.shape == v.scale.shape == (1, 2, 3)
    with pytest.raises(RuntimeError, match="no call selects fwd/fp8/64/ws/plain/out-bf16"):
        sanitize._run_fp8(tile_policy.fp8(64, False, "bfloat16"), rng, AMPERE)


def test_the_worker_reports_the_fp8_kernels_it_ran(sanitize):
    variant = tile_policy.fp8(256, True, "bfloat16")
    names = sanitize.kernel_names(variant)
    assert names == [variant.name_expression("fwd"), gpu_fp8.KERNEL]
    assert "e4m3_t" in names[0] and gpu_fp8.KERNEL in sanitize.KERNEL_FAMILIES
    label = sanitize.variant_label(variant)
    text = "".join(f"RAN {label} {name}\n" for name in names) + "WORKER DONE 1 variants, 0 failed\n"
    ran, failures, finished = sanitize.parse_worker(text)
    assert ran == {sanitize.normalize_kernel(*sanitize._KERNEL.search(name).groups()) for name in names}
    assert gpu_fp8.KERNEL in ran and not failures and finished
    # The 16-bit variants report their kernels alone, as before.
    half = Variant("bwd", "bfloat16", 64, "ws", causal=True)
    assert sanitize.kernel_names(half) == [half.name_expression(kernel) for kernel in half.kernels]


def test_help_runs_without_a_gpu(sanitize, capsys):
    with pytest.raises(SystemExit) as exit_:
        sanitize.main(["--help"])
    assert exit_.value.code == 0
    assert "--variants" in capsys.readouterr().out


def test_the_report_counts_unprinted_errors_apart(sanitize):
    """A sanitizer log prints its first errors only: the summary is the count of record, printed errors are
    blamed on their kernels, the rest are counted as not printed (not as 'other', not twice)."""
    kernel = "attention_bwd_dq_convert_kernel<half_t, (int)64, (int)128, (bool)0, (int)2>(AttnParams, const float *)"
    error = (
        "========= Uninitialized __global__ memory read of size 16 bytes\n"
        f"=========     at void {kernel}+0x2e0\n=========     by thread (2,0,0) in block (0,4,0)\n=========\n"
    )
    text = (
        "========= COMPUTE-SANITIZER\n" + 3 * error + "========= ERROR SUMMARY: 1003 errors\n"
        "========= ERROR SUMMARY: 1000 errors were not printed. Use --print-limit option to adjust\n"
    )
    summary, warnings, errors = sanitize.parse_report(text)
    assert summary == 1003 and warnings == 0
    assert errors == {
        sanitize.normalize_kernel(*sanitize._KERNEL.search(kernel).groups()): 3,
        sanitize.NOT_PRINTED: 1000,
    }
    # Every error printed: nothing left over.
    text = "========= COMPUTE-SANITIZER\n" + error + "========= ERROR SUMMARY: 1 error\n"
    summary, _, errors = sanitize.parse_report(text)
    assert summary == 1 and sum(errors.values()) == 1 and sanitize.NOT_PRINTED not in errors


def test_zeroed_empty_allocates_zeros_and_passes_the_rest_through(sanitize):
    """The initcheck run's stand-in for the fused backward's cupy module (NumPy behind it here)."""
    stand_in = sanitize._ZeroedEmpty(np)
    x = stand_in.empty(5, dtype=np.float32)
    assert x.dtype == np.float32 and not x.any()
    assert stand_in.float32 is np.float32
