"""Every shipped kernel variant compiles through NVRTC for sm_80 and sm_90, with no spills, no stack and no
serialized wgmma.

The mma.sync variants build for both; the wgmma ones (Hopper) for sm_90a, reported under sm_90. No GPU is
needed: ``cupyflash._kernels.compile_report(arch)`` runs NVRTC with ``-Xptxas -v`` and parses ptxas' report. Each arch is compiled once per session (module-scoped fixture); the assertions are
parametrized over the arches.

NVRTC comes from the ``cuda12``/``cuda13`` extra. Where it cannot be loaded these tests skip, except under
``CI=true``, where they fail: CI installs the extra, so a missing NVRTC there is a broken install.
"""

import os

import pytest

pytestmark = pytest.mark.compile

ARCHES = ("sm_80", "sm_90")
# Per-block limits a kernel must fit (CUDA C++ Programming Guide, compute capabilities table).
MAX_SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
REGISTERS_PER_BLOCK = 64 * 1024
REGISTER_ALLOCATION_UNIT = 8  # registers per thread are allocated in steps of 8 (256 per warp)
MAX_REGISTERS_PER_THREAD = 255
REPORT_FIELDS = {
    "kernel": str, "arch": str, "target": str, "registers": int, "spill_stores": int, "spill_loads": int,
    "stack_frame": int, "static_smem": int, "dynamic_smem": int, "threads": int, "serialized_wgmma": int,
}


def _in_ci():
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _unavailable(reason):
    if _in_ci():
        pytest.fail(f"{reason}; under CI=true the compile tests must run (install the cuda12 extra)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def kernels():
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or CuPy failing to load its CUDA libraries
        _unavailable(f"CuPy cannot be imported: {exc!r}")
    from cupyflash import _kernels

    try:
        version = _kernels.nvrtc_version()
    except Exception as exc:
        _unavailable(f"NVRTC cannot be loaded: {exc!r}")
    print(f"NVRTC {version[0]}.{version[1]}")
    return _kernels


@pytest.fixture(scope="module", params=ARCHES)
def report(request, kernels):
    arch = request.param
    try:
        rows = kernels.compile_report(arch)
    except Exception as exc:
        pytest.fail(f"compile_report({arch!r}) raised {type(exc).__name__}:\n{exc}", pytrace=False)
    return arch, list(rows)


def _allocated_registers(row):
    unit = REGISTER_ALLOCATION_UNIT
    return -(-row["registers"] // unit) * unit


def _table(rows):
    return "\n".join(
        f"  {r['kernel']}: {r['registers']} registers, {r['threads']} threads, "
        f"spill stores {r['spill_stores']} B, spill loads {r['spill_loads']} B, "
        f"stack {r['stack_frame']} B, smem {r['static_smem']} + {r['dynamic_smem']} B"
        for r in rows
    )


def test_every_variant_compiled(report, kernels):
    arch, rows = report
    assert rows, f"compile_report({arch!r}) returned no kernels"
    bad_fields = [
        (r.get("kernel"), name)
        for r in rows
        for name, kind in REPORT_FIELDS.items()
        if not isinstance(r.get(name), kind)
    ]
    assert not bad_fields, f"{arch}: missing or mistyped report fields (kernel, field): {bad_fields}"
    assert all(r["arch"] == arch for r in rows), f"{arch}: rows for another arch: {rows}"
    # A kernel shared by several variants' modules (the backward's preprocess) is reported once per module:
    # every copy built for the same target (sm_90 and sm_90a differ) must have the same resources.
    by_name = {}
    for r in rows:
        by_name.setdefault((r["kernel"], r["target"]), []).append(r)
    inconsistent = [copies for copies in by_name.values() if any(c != copies[0] for c in copies)]
    assert not inconsistent, (
        f"{arch}: one kernel, different reports:\n" + "\n".join(_table(c) for c in inconsistent)
    )
    variants = kernels.variants_for(arch)
    assert len(rows) >= len(variants), (
        f"{arch}: {len(variants)} shipped variants but only {len(rows)} kernels compiled:\n{_table(rows)}"
    )
    assert all(r["registers"] > 0 and r["threads"] > 0 for r in rows), f"{arch}:\n{_table(rows)}"


def test_no_register_spills(report):
    arch, rows = report
    offenders = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not offenders, f"{arch}: {len(offenders)} of {len(rows)} kernels spill:\n{_table(offenders)}"


def test_no_serialized_wgmma(report):
    """ptxas notes C7510-C7519 (wgmma serialized, e.g. by a branch inside a pipelined loop) cost a wgmma
    kernel its overlap of products and softmax: none may have them."""
    arch, rows = report
    offenders = [r for r in rows if r["serialized_wgmma"]]
    assert not offenders, (
        f"{arch}: {len(offenders)} of {len(rows)} kernels have serialized wgmma:\n{_table(offenders)}"
    )


def test_no_stack_frame(report):
    arch, rows = report
    offenders = [r for r in rows if r["stack_frame"]]
    assert not offenders, (
        f"{arch}: {len(offenders)} of {len(rows)} kernels use a stack frame:\n{_table(offenders)}"
    )


def test_fits_on_one_sm(report):
    arch, rows = report
    offenders = [
        r for r in rows
        if r["static_smem"] + r["dynamic_smem"] > MAX_SMEM_PER_BLOCK[arch]
        or r["registers"] > MAX_REGISTERS_PER_THREAD
        or _allocated_registers(r) * r["threads"] > REGISTERS_PER_BLOCK
    ]
    assert not offenders, (
        f"{arch}: kernels over the per-block limits (shared memory {MAX_SMEM_PER_BLOCK[arch]} B, "
        f"{REGISTERS_PER_BLOCK} registers per block):\n{_table(offenders)}"
    )


def test_serialized_wgmma_is_detected(kernels):
    """The check above sees what it guards against: the wgmma forward with the loads' whole-tile branch
    (which only the backward takes, cuda_src/copy.cuh) is reported serialized; the shipped one is not."""
    variant = kernels.Variant("fwd", "bfloat16_t", 128, True, wgmma=True)
    names = {"fwd": variant.name_expression("fwd")}
    shipped = variant.code()
    branchy = shipped.replace("load_tile_async<KVTile, THREADS>(", "load_tile_async<KVTile, THREADS, true>(")
    assert branchy != shipped, "the forward's K/V loads are no longer spelled as this test expects"
    options = [*kernels._OPTIONS, "-arch=sm_90a", "-Xptxas", "-v"]
    found = {label: kernels._compile_for_report(variant, "sm_90a", options, names, code)["fwd"]["serialized_wgmma"]
             for label, code in (("shipped", shipped), ("branchy", branchy))}
    assert found["shipped"] == 0 and found["branchy"] > 0, found
