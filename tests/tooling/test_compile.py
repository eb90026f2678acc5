"""The compile audit: every shipped kernel variant compiles through NVRTC for sm_80 and sm_90, with no spills,
no stack frame and no serialized warpgroup products (wgmma).

The mma.sync variants build for both; Hopper's paths (wgmma, float32 pieces, the warp-specialized forward)
for sm_90a, reported under sm_90; the float64 tiles that need Hopper's shared memory for sm_90 alone. No GPU
is needed: ``cupyflash._cuda.ptxas_report.compile_report(arch)`` runs NVRTC with ``-Xptxas -v`` and parses
ptxas' report. Reports are kept on disk (``$CUPY_CACHE_DIR/cupyflash-ptxas``), so after
``python -m cupyflash --compile-report`` this only reads them. Each arch is compiled once per session
(module-scoped fixture); the assertions are parametrized over the arches. Every test but the parser's is
marked ``compile`` (deselect with ``-m "not compile"``).

NVRTC comes from the ``cuda12``/``cuda13`` extra. Where it cannot be loaded these tests skip, except under
``CI=true``, where they fail: CI installs the extra, so a missing NVRTC there is a broken install.
"""

import os

import pytest

ARCHES = ("sm_80", "sm_90")
# Per-block limits a kernel must fit (CUDA C++ Programming Guide, compute capabilities table).
MAX_SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
REGISTERS_PER_BLOCK = 64 * 1024
REGISTER_ALLOCATION_UNIT = 8  # registers per thread are allocated in steps of 8 (256 per warp)
MAX_REGISTERS_PER_THREAD = 255
REPORT_FIELDS = {
    "kernel": str,
    "arch": str,
    "target": str,
    "registers": int,
    "spill_stores": int,
    "spill_loads": int,
    "stack_frame": int,
    "static_smem": int,
    "dynamic_smem": int,
    "threads": int,
    "serialized_wgmma": int,
}


def _in_ci():
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _unavailable(reason):
    if _in_ci():
        pytest.fail(f"{reason}; under CI=true the compile tests must run (install the cuda12 extra)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def ptxas_report():
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or CuPy failing to load its CUDA libraries
        _unavailable(f"CuPy cannot be imported: {exc!r}")
    from cupyflash._cuda import ptxas_report

    try:
        version = ptxas_report.nvrtc_version()
    except Exception as exc:
        _unavailable(f"NVRTC cannot be loaded: {exc!r}")
    print(f"NVRTC {version[0]}.{version[1]}")
    return ptxas_report


@pytest.fixture(scope="module", params=ARCHES)
def report(request, ptxas_report):
    arch = request.param
    try:
        rows = ptxas_report.compile_report(arch)
    except Exception as exc:
        pytest.fail(f"compile_report({arch!r}) raised {type(exc).__name__}:\n{exc}", pytrace=False)
    return arch, list(rows)


def _allocated_registers(row):
    unit = REGISTER_ALLOCATION_UNIT
    return -(-row["registers"] // unit) * unit


def _table(rows):
    return "\n".join(
        f"  {r['kernel']} ({r['target']}): {r['registers']} registers, {r['threads']} threads, "
        f"spill stores {r['spill_stores']} B, spill loads {r['spill_loads']} B, "
        f"stack {r['stack_frame']} B, smem {r['static_smem']} + {r['dynamic_smem']} B"
        for r in rows
    )


@pytest.mark.compile
def test_every_shipped_variant_compiled(report):
    """One row per kernel of every variant built for the arch (its name expression), plus the float32 split
    kernel, ring attention's running-result kernels and the FP8 forward's V^T; every field present and typed; a kernel
    shared by several modules (the backward's preprocess) has the same resources in each copy built for one target
    (sm_90 and sm_90a differ)."""
    from cupyflash._cuda import f32_pieces, fp8, ring_states
    from cupyflash._cuda.ptxas_report import shipped_for

    arch, rows = report
    assert rows, f"compile_report({arch!r}) returned no kernels"
    bad_fields = [
        (r.get("kernel"), name)
        for r in rows
        for name, kind in REPORT_FIELDS.items()
        if not isinstance(r.get(name), kind)
    ]
    assert not bad_fields, f"{arch}: missing or mistyped report fields (kernel, field): {bad_fields}"
    assert all(r["arch"] == arch for r in rows), f"{arch}: rows for another arch"
    by_name = {}
    for r in rows:
        by_name.setdefault((r["kernel"], r["target"]), []).append(r)

    # (static shared memory aside: ptxas counts what the module around a kernel declares, and the preprocess
    # is built beside the dK/dV pass in the two-pass backward's module and alone for the fused one)
    def resources(row):
        return {name: value for name, value in row.items() if name != "static_smem"}

    inconsistent = [copies for copies in by_name.values() if any(resources(c) != resources(copies[0]) for c in copies)]
    assert not inconsistent, f"{arch}: one kernel, different reports:\n" + "\n".join(_table(c) for c in inconsistent)

    variants = shipped_for(arch)
    assert variants, f"no variant is built for {arch}"
    expected = (
        {v.name_expression(kernel) for v in variants for kernel in v.kernels}
        | set(f32_pieces.KERNELS)
        | set(ring_states.KERNELS)
        | {fp8.KERNEL}
    )
    compiled = {r["kernel"] for r in rows}
    missing = sorted(expected - compiled)
    assert not missing, f"{arch}: {len(missing)} kernels not compiled, e.g. {missing[:5]}"
    assert compiled <= expected, f"{arch}: kernels no shipped variant names: {sorted(compiled - expected)[:5]}"
    assert len(rows) == sum(len(v.kernels) for v in variants) + len(f32_pieces.KERNELS) + len(ring_states.KERNELS) + 1
    assert all(r["registers"] > 0 and r["threads"] > 0 for r in rows), f"{arch}:\n{_table(rows)}"


@pytest.mark.compile
def test_targets_are_the_variants_own(report):
    """mma.sync kernels build for the arch itself, Hopper's paths for sm_90a (reported under sm_90)."""
    from cupyflash._cuda.ptxas_report import shipped_for

    arch, rows = report
    targets = {}
    for v in shipped_for(arch):
        for kernel in v.kernels:
            targets.setdefault(v.name_expression(kernel), set()).add(v.compile_targets()[arch])
    wrong = [r for r in rows if r["kernel"] in targets and r["target"] not in targets[r["kernel"]]]
    assert not wrong, f"{arch}: built for another target:\n{_table(wrong)}"
    assert {r["target"] for r in rows} <= {arch, "sm_90a"}
    if arch == "sm_80":
        assert all(r["target"] == "sm_80" for r in rows)


@pytest.mark.compile
def test_no_register_spills(report):
    arch, rows = report
    offenders = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not offenders, f"{arch}: {len(offenders)} of {len(rows)} kernels spill:\n{_table(offenders)}"


@pytest.mark.compile
def test_no_serialized_wgmma(report):
    """ptxas notes C7510-C7519 (wgmma serialized, e.g. by a branch inside a pipelined loop) cost a wgmma
    kernel its overlap of products and softmax: none may have them."""
    arch, rows = report
    offenders = [r for r in rows if r["serialized_wgmma"]]
    assert not offenders, f"{arch}: {len(offenders)} of {len(rows)} kernels have serialized wgmma:\n{_table(offenders)}"


@pytest.mark.compile
def test_no_stack_frame(report):
    arch, rows = report
    offenders = [r for r in rows if r["stack_frame"]]
    assert not offenders, f"{arch}: {len(offenders)} of {len(rows)} kernels use a stack frame:\n{_table(offenders)}"


@pytest.mark.compile
def test_fits_on_one_sm(report):
    arch, rows = report
    offenders = [
        r
        for r in rows
        if r["static_smem"] + r["dynamic_smem"] > MAX_SMEM_PER_BLOCK[arch]
        or r["registers"] > MAX_REGISTERS_PER_THREAD
        or _allocated_registers(r) * r["threads"] > REGISTERS_PER_BLOCK
    ]
    assert not offenders, (
        f"{arch}: kernels over the per-block limits (shared memory {MAX_SMEM_PER_BLOCK[arch]} B, "
        f"{REGISTERS_PER_BLOCK} registers per block):\n{_table(offenders)}"
    )


@pytest.mark.compile
def test_serialized_wgmma_is_detected(ptxas_report):
    """The check above sees what it guards against: the wgmma forward with the loads' whole-tile branch
    (which only the backward takes, cuda_src/copy.cuh) is reported serialized; the shipped one is not."""
    from cupyflash._cuda.source import OPTIONS
    from cupyflash._cuda.variants import Variant

    variant = Variant("fwd", "bfloat16", 128, "wgmma", causal=True)
    names = {"fwd": variant.name_expression("fwd")}
    shipped = variant.code()
    branchy = shipped.replace("load_tile_async<KVTile, THREADS>(", "load_tile_async<KVTile, THREADS, true>(")
    assert branchy != shipped, "the forward's K/V loads are no longer spelled as this test expects"
    options = [*OPTIONS, "-arch=sm_90a", "-Xptxas", "-v"]
    found = {
        label: ptxas_report._compile(code, "fwd.cu", options, names)["fwd"]["serialized_wgmma"]
        for label, code in (("shipped", shipped), ("branchy", branchy))
    }
    assert found["shipped"] == 0 and found["branchy"] > 0, found


def test_parse_ptxas_reads_every_field():
    """parse_ptxas on a log in ptxas' own words: registers, static shared memory, the stack frame and spills
    of each entry, and the serialization notes that name a function."""
    log = "\n".join(
        [
            "ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'",
            "ptxas info    : Function properties for _Z1av",
            "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads",
            "ptxas info    : Used 168 registers, used 1 barriers, 528 bytes smem, 904 bytes cmem[0]",
            "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'",
            "ptxas info    : Function properties for _Z1bv",
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            "ptxas info    : Used 90 registers, used 1 barriers, 904 bytes cmem[0]",
            "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "the presence of Extern calls in the function '_Z1bv'",
        ]
    )
    from cupyflash._cuda.ptxas_report import parse_ptxas

    found = parse_ptxas(log)
    assert found["_Z1av"] == {
        "registers": 168,
        "spill_stores": 4,
        "spill_loads": 12,
        "stack_frame": 8,
        "static_smem": 528,
        "serialized_wgmma": 0,
    }
    assert found["_Z1bv"] == {
        "registers": 90,
        "spill_stores": 0,
        "spill_loads": 0,
        "stack_frame": 0,
        "static_smem": 0,
        "serialized_wgmma": 1,
    }


def test_parse_ptxas_counts_a_called_functions_spills_for_its_entry():
    """A function that is not inlined gets its own properties after its caller's: its spills count for the entry
    that calls it, and its clean report never stands in for the entry's spills."""
    log = "\n".join(
        [
            "ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'",
            "ptxas info    : Function properties for _Z1av",
            "    104 bytes stack frame, 28 bytes spill stores, 28 bytes spill loads",
            "ptxas info    : Function properties for _Z6calleev",
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            "ptxas info    : Used 168 registers, used 1 barriers, 904 bytes cmem[0]",
            "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'",
            "ptxas info    : Function properties for _Z1bv",
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            "ptxas info    : Function properties for _Z6calleev",
            "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
            "ptxas info    : Used 96 registers, used 1 barriers, 904 bytes cmem[0]",
        ]
    )
    from cupyflash._cuda.ptxas_report import parse_ptxas

    found = parse_ptxas(log)
    assert (found["_Z1av"]["spill_stores"], found["_Z1av"]["stack_frame"]) == (28, 104)
    assert (found["_Z1bv"]["spill_stores"], found["_Z1bv"]["spill_loads"], found["_Z1bv"]["stack_frame"]) == (8, 4, 16)
    assert "_Z6calleev" not in found
