"""Which kernel variant a call selects, and with which tiles (no GPU needed: selection is a pure function of
the call's ``Features`` and the device's abilities, ``Device``). The table itself: test_tiles.py."""

import dataclasses
import re
import types

import ml_dtypes
import numpy as np

from cupyflash import _dropout, _modifiers
from cupyflash._cuda import dense, fused_backward, launch, tile_policy, tiles, tma
from cupyflash._cuda.source import source
from cupyflash._cuda.variants import BOUNDED_SOFTCAP_MAX, DTYPES, FP8, MODS, PATHS, SCORES, Device, Features, Variant

HOPPER = Device(wgmma=True, large_smem=True)
AMPERE = Device()  # mma.sync and an sm_80 CTA's shared memory: every GPU but Hopper (and no GPU at all)
LARGE_SMEM_ONLY = Device(large_smem=True)  # compute capability > 9.0, or Hopper with CUPYFLASH_NO_WGMMA=1
BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = ((np.float16, "half_t"), (ml_dtypes.bfloat16, "bfloat16_t"))
ON = np.ones((1, 1), bool)  # a block mask of one tile: (2, 3, 100 x 120) has one 128 x 128 tile
SLOPES = np.ones(3, np.float32)
DROPOUT = _dropout.Dropout(0.1, 1)
SHIPPED = tile_policy.shipped_variants()
SHIPPED_SET = set(SHIPPED)


def _chosen(
    direction="fwd",
    dtype=np.float16,
    head_dim=128,
    causal=True,
    device=HOPPER,
    dropout=None,
    packed=False,
    tma_ok=True,
    dv=None,
    **options,
):
    """The variant of a (2, 3, 100 x 120) call with these options (resolved as the API resolves them)."""
    mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, **options)
    features = Features.of(
        direction, np.dtype(dtype), head_dim, head_dim if dv is None else dv, causal, mods, dropout, packed
    )
    if not tma_ok:
        features = dataclasses.replace(features, tma=False)
    return tile_policy.dense(features, device)


def _bool(x):
    return "true" if x else "false"


def _wgmma_head_dims(itemsize=2):
    return sorted({head_dim for path, size, head_dim, _, _ in tiles.CELLS if path == "wgmma" and size == itemsize})


# ------------------------------------------------------------------------------------------ the records
def test_shipped_variants_are_distinct_and_well_formed():
    assert len(SHIPPED) == len(SHIPPED_SET), "a variant is listed twice"
    for v in SHIPPED:
        assert v.direction in ("fwd", "bwd", "probs") and v.dtype in DTYPES + (FP8,) and v.path in PATHS, v
        # the FP8 forward's out differs from its inputs, and the unrounded results of 16-bit inputs
        assert bool(v.out_dtype) == (v.dtype == FP8 or v.wide), v
        assert not v.wide or (v.dtype in ("float16", "bfloat16") and v.head_dim in tile_policy.WIDE_HEAD_DIMS), v
        assert v.mods in MODS and v.score in SCORES and v.head_dim in tiles.HEAD_DIMS, v
        assert not (v.causal and v.mods not in ("none", "softcap")), f"{v}: causal travels in the window"
        assert v.direction != "probs" or (v.mods == "all" and not v.dropout), v
        assert v.score == "plain" or v.direction == "fwd", v
        assert not v.block_mask or (v.path == "ws" and v.mods == "scalars"), v
    assert {v.dtype for v in SHIPPED} == set(DTYPES) | {FP8}
    assert {v.path for v in SHIPPED} == set(PATHS)


def test_features_of_a_call():
    """Features.of: the dtype by name, the head dims as 16-byte rows (max of D and Dv), the options as flags."""
    f = Features.of("fwd", BF16, 100, 120, True)
    assert (f.direction, f.dtype, f.head_dim, f.causal, f.has_mods, f.dropout, f.packed) == (
        "fwd",
        "bfloat16",
        120,
        True,
        False,
        False,
        False,
    )
    assert Features.of("bwd", np.dtype(np.float16), 36, 20, False).head_dim == 40  # 8 halves per 16 bytes
    assert Features.of("bwd", np.dtype(np.float32), 37, 5, False).head_dim == 40  # 4 floats
    assert Features.of("bwd", np.dtype(np.float64), 3, 1, False).head_dim == 4  # 2 doubles
    mods = _modifiers.resolve(
        np, np.dtype(np.float16), (2, 3), 100, 120, window=(10, -1), softcap=3.0, alibi_slopes=SLOPES, block_mask=ON
    )
    f = Features.of("fwd", np.dtype(np.float16), 64, 64, True, mods, DROPOUT, packed=True)
    assert (f.window, f.softcap, f.alibi, f.arrays, f.block_mask, f.dropout, f.packed) == (
        (10, -1),
        3.0,
        True,
        False,
        True,
        True,
        True,
    )
    assert f.has_mods and f.right_edge
    assert not Features("fwd", "float16", 64, window=(10, -1)).right_edge
    assert Features("fwd", "float16", 64, window=(-1, 3)).right_edge
    for name in ("bias", "mask"):
        array = np.zeros((100, 120), np.float16) if name == "bias" else np.ones((100, 120), bool)
        mods = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, **{name: array})
        assert Features.of("fwd", np.dtype(np.float16), 64, 64, False, mods).arrays


def test_variant_in_words():
    assert str(Variant("fwd", "bfloat16", 128, "ws", causal=True)) == "fwd bfloat16 HEAD_DIM=128 causal (ws)"
    assert str(Variant("bwd", "float32", 96)) == "bwd float32 HEAD_DIM=96 plain (mma)"
    words = str(Variant("fwd", "float16", 128, "ws", "scalars", score="alibi_half_first", block_mask=True))
    assert "modifiers (window, softcap, ALiBi)" in words and "alibi_half_first" in words and "block mask" in words
    assert "dropout" in str(Variant("fwd", "float16", 64, mods="all", dropout=True))
    assert "softcap alone" in str(Variant("bwd", "float16", 64, "wgmma", "softcap", causal=True))


# ------------------------------------------------------------------------------------------ the modifiers' forms
def test_plain_calls_take_no_modifiers():
    for device in (AMPERE, HOPPER):
        variant = _chosen(head_dim=64, device=device)
        assert variant.mods == "none" and variant.causal and variant.score == "plain"
        assert "Mods::none" in variant.name_expression("fwd")


def test_window_softcap_and_alibi_take_the_scalars_form():
    for options in (
        dict(window=(10, 0)),
        dict(softcap=5.0),
        dict(alibi_slopes=SLOPES),
        dict(window=(10, 5), softcap=5.0, alibi_slopes=SLOPES),
    ):
        for direction in ("fwd", "bwd"):
            variant = _chosen(direction, head_dim=64, device=AMPERE, **options)
            assert variant.mods == "scalars" and not variant.causal and variant.path == "mma", options
            assert "Mods::scalars" in variant.name_expression(direction if direction == "fwd" else "dq")


def test_a_block_mask_takes_the_scalars_backward_and_the_full_forward():
    """Away from the warp-specialized forward (which walks it where its key blocks are the mask's tiles: below),
    a block mask is read by the forward's ``all`` form; the backward's scalars form skips its tiles. Hopper's
    head dim 256 streams 64-key blocks."""
    for options in (dict(block_mask=ON), dict(window=(10, 5), softcap=5.0, block_mask=ON)):
        for device, head_dim in ((AMPERE, 64), (AMPERE, 128), (HOPPER, 256)):
            forward, backward = (_chosen(d, head_dim=head_dim, device=device, **options) for d in ("fwd", "bwd"))
            assert forward.mods == "all" and "Mods::all" in forward.name_expression("fwd"), options
            assert backward.mods == "scalars" and "Mods::scalars" in backward.name_expression("dq"), options
            assert not forward.block_mask and not backward.block_mask


def test_arrays_dropout_probs_and_float64_take_the_full_form():
    for name, array in (("bias", np.zeros((100, 120), np.float16)), ("mask", np.ones((100, 120), bool))):
        for direction in ("fwd", "bwd"):
            variant = _chosen(direction, head_dim=64, device=AMPERE, window=(10, 0), block_mask=ON, **{name: array})
            assert variant.mods == "all", name
            assert "Mods::all" in variant.name_expression("fwd" if direction == "fwd" else "dkdv")
    with_dropout = _chosen(head_dim=64, device=AMPERE, dropout=DROPOUT, window=(10, 0))
    assert with_dropout.mods == "all" and with_dropout.dropout
    assert _chosen("probs", head_dim=64, causal=False, device=AMPERE, softcap=5.0).mods == "all"
    assert _chosen("probs", head_dim=64, causal=False, device=AMPERE).mods == "all"  # probs always reads options
    for device in (AMPERE, HOPPER):
        float64 = _chosen(dtype=np.float64, head_dim=64, causal=False, device=device, softcap=5.0)
        assert float64.mods == "all" and float64.path == "mma", "float64 has no scalars form"


def test_packed_batches_take_the_modifiers_kernels():
    """Variable-length batches read cu_seqlens at run time: the modifiers' kernels, even with no option."""
    for device in (AMPERE, HOPPER):
        for dtype in (np.float16, np.float32):
            plain = _chosen("fwd", dtype, 64, device=device, packed=True)
            assert plain.mods == "scalars" and not plain.causal and plain.path in ("mma", "wgmma"), plain
            assert plain.path != "ws"
    assert _chosen("bwd", np.float64, 64, device=HOPPER, packed=True).mods == "all"
    assert _chosen("fwd", np.float16, 64, device=AMPERE, packed=True, dropout=DROPOUT).mods == "all"


def test_every_scalars_variant_is_shipped_beside_its_full_one():
    """The scalars, softcap-alone and window-alone forms are faster forms of the ``all`` one, which every
    such call could take: it is shipped too (on the warp-specialized forward's own path, the wgmma one)."""
    narrow = [v for v in SHIPPED if v.mods in ("scalars", "softcap", "window")]
    assert narrow and all(not v.dropout and v.direction in ("fwd", "bwd") and v.itemsize in (2, 4) for v in narrow)
    for v in narrow:
        full = dataclasses.replace(
            v, mods="all", causal=False, score="plain", block_mask=False, path="wgmma" if v.path == "ws" else v.path
        )
        assert full in SHIPPED_SET, v


def test_a_softcap_alone_takes_the_softcap_backward_on_the_wgmma_path():
    """A 16-bit wgmma backward whose only modifier is a softcap runs Mods::softcap, causal as the plain kernels
    take it; anything more (or its forward, float32, dropout, a packed batch, the mma.sync path) does not."""
    for dtype, _ in HALVES:
        for causal in (False, True):
            chosen = _chosen("bwd", dtype, causal=causal, softcap=5.0)
            assert chosen.mods == "softcap" and chosen.path == "wgmma" and chosen.causal == causal
            assert f"{_bool(causal)}, Mods::softcap, true" in chosen.name_expression("dkdv")
            assert chosen in SHIPPED_SET
    for options in (
        dict(softcap=5.0, window=(10, 0)),
        dict(softcap=5.0, window=(-1, 0)),
        dict(softcap=5.0, alibi_slopes=SLOPES),
        dict(softcap=5.0, block_mask=ON),
        dict(softcap=5.0, bias=np.zeros((100, 120), np.float16)),
        dict(window=(10, 0)),
    ):
        chosen = _chosen("bwd", **options)
        assert chosen.mods != "softcap" and not chosen.causal, options
    assert _chosen("fwd", softcap=5.0).mods != "softcap"
    assert _chosen("bwd", np.float32, softcap=5.0).mods != "softcap"
    assert _chosen("bwd", softcap=5.0, dropout=DROPOUT).mods != "softcap"
    assert _chosen("bwd", softcap=5.0, packed=True).mods != "softcap"
    assert _chosen("bwd", softcap=5.0, device=AMPERE).mods == "scalars"
    shipped = {v for v in SHIPPED if v.mods == "softcap"}
    assert shipped == {
        Variant("bwd", dtype, head_dim, "wgmma", "softcap", causal)
        for dtype in ("float16", "bfloat16")
        for head_dim in _wgmma_head_dims()
        for causal in (False, True)
    }


def test_a_window_alone_takes_the_window_form_on_the_wgmma_path():
    """A 16-bit wgmma forward or backward whose only modifier is a window (causal travelling in it) runs
    Mods::window; a softcap, ALiBi, a block mask, an array, dropout, float32, a packed batch or the mma.sync
    path take the other forms."""
    for dtype, _ in HALVES:
        for direction in ("fwd", "bwd"):
            for causal, window in ((True, (10, 0)), (False, (5, 17)), (False, (-1, 3)), (True, (0, -1))):
                chosen = _chosen(direction, dtype, causal=causal, window=window)
                assert chosen.mods == "window" and not chosen.causal and chosen.score == "plain", window
                assert chosen.path == ("ws" if direction == "fwd" and 128 in tiles.WS_HEAD_DIMS else "wgmma")
                name = chosen.name_expression(direction if direction == "fwd" else "dkdv")
                assert "false, Mods::window" in name and chosen in SHIPPED_SET, name
    for options in (
        dict(window=(10, 0), softcap=5.0),
        dict(window=(10, 0), alibi_slopes=SLOPES),
        dict(window=(10, 0), block_mask=ON),
        dict(window=(10, 0), bias=np.zeros((100, 120), np.float16)),
        dict(window=(10, 0), mask=np.ones((100, 120), bool)),
        dict(softcap=5.0),
    ):
        for direction in ("fwd", "bwd"):
            assert _chosen(direction, **options).mods != "window", (direction, options)
    assert _chosen(dtype=np.float32, window=(10, 0)).mods != "window"
    assert _chosen(window=(10, 0), dropout=DROPOUT).mods != "window"
    assert _chosen(window=(10, 0), packed=True).mods != "window"
    assert _chosen(window=(10, 0), device=AMPERE).mods == "scalars"
    for head_dim in _wgmma_head_dims():
        for direction in ("fwd", "bwd"):
            chosen = _chosen(direction, head_dim=head_dim, window=(10, 0))
            assert chosen.mods == "window" and chosen in SHIPPED_SET, (head_dim, direction)


def test_the_window_alone_forward_takes_its_own_tiles_and_ctas_per_sm():
    """Where the table gives the wgmma forward's window form its own cell, that form launches and names it,
    CTAs per SM included (its launch bounds); every other wgmma forward keeps one CTA's bound."""
    own = 0
    for head_dim in _wgmma_head_dims():
        # (where the warp-specialized forward serves, this one remains for inputs TMA cannot read)
        chosen = _chosen(head_dim=head_dim, window=(10, 0), tma_ok=False)
        assert chosen.path == "wgmma" and chosen.mods == "window"
        cell = tiles.lookup("wgmma", 2, head_dim, "fwd", "window")
        assert chosen.tiles("fwd") == cell
        assert chosen.name_expression("fwd") == (
            f"attention_fwd_wgmma_kernel<half_t, {head_dim}, {cell.num_warps}, {cell.block}, false, Mods::window, "
            f"false, false, {cell.ctas_per_sm}, half_t>"
        )
        scalars = dataclasses.replace(chosen, mods="scalars")
        assert scalars.tiles("fwd").ctas_per_sm == 1
        if cell.ctas_per_sm > 1:
            own += 1
            assert scalars.tiles("fwd") != cell
    assert own, "the table gives no window forward several CTAs per SM"
    for variant in SHIPPED:
        if variant.direction == "fwd" and variant.path in ("wgmma", "pieces") and variant.mods != "window":
            assert variant.name_expression("fwd").endswith(f", 1, {variant.results}>"), variant


def test_the_window_alone_backward_takes_its_own_tiles():
    """Where the table's window cells of the wgmma backward differ from its scalars cells, the window form
    launches and names its own."""
    differ = 0
    for head_dim in _wgmma_head_dims():
        chosen = _chosen("bwd", head_dim=head_dim, window=(10, 0))
        scalars = dataclasses.replace(chosen, mods="scalars")
        assert chosen.mods == "window" and chosen.path == "wgmma"
        for kernel in ("dkdv", "dq"):
            t = tiles.lookup("wgmma", 2, head_dim, kernel, "window")
            assert chosen.tiles(kernel) == t
            expected = f"<half_t, {head_dim}, {t.num_warps}, {t.block}, {t.d_chunk}, false, Mods::window,"
            assert expected in chosen.name_expression(kernel), chosen.name_expression(kernel)
            differ += scalars.tiles(kernel) != t
    assert differ, "no window backward has tiles of its own"


def test_float32_on_hopper_runs_on_float16_pieces():
    """Plain and causal float32 at the pieces' head dims on Hopper; with dropout, modifiers or elsewhere
    the mma.sync kernels."""
    pieces = sorted({head_dim for path, _, head_dim, _, _ in tiles.CELLS if path == "pieces"})
    assert pieces
    for head_dim in tiles.HEAD_DIMS:
        for direction in ("fwd", "bwd"):
            for causal in (False, True):
                chosen = _chosen(direction, np.float32, head_dim, causal, device=HOPPER)
                assert chosen.path == ("pieces" if head_dim in pieces else "mma"), (head_dim, direction)
                assert chosen in SHIPPED_SET
                assert _chosen(direction, np.float32, head_dim, causal, device=AMPERE).path == "mma"
            assert _chosen(direction, np.float32, head_dim, device=HOPPER, dropout=DROPOUT).path == "mma"
            assert _chosen(direction, np.float32, head_dim, device=HOPPER, window=(10, 0)).path == "mma"
    assert _chosen("probs", np.float32, 64, False, device=HOPPER).path == "mma"


def test_float64_takes_the_large_tiles_where_the_shared_memory_allows():
    large = sorted({head_dim for path, _, head_dim, _, _ in tiles.CELLS if path == "large"})
    assert large
    for head_dim in tiles.HEAD_DIMS:
        for device in (HOPPER, LARGE_SMEM_ONLY):
            chosen = _chosen("bwd", np.float64, head_dim, device=device)
            assert chosen.path == ("large" if head_dim in large else "mma") and chosen in SHIPPED_SET
        assert _chosen("bwd", np.float64, head_dim, device=AMPERE).path == "mma"
    # A variant whose shared memory exceeds an sm_80 CTA's is built for sm_90 alone.
    for v in SHIPPED:
        fits = max(v.smem(kernel) for kernel in v.kernels) <= tiles.SM80_SMEM_BYTES
        if v.path in ("mma",):
            assert set(v.compile_targets()) == ({"sm_80", "sm_90"} if fits else {"sm_90"}), v
        else:
            assert v.compile_targets() == {"sm_90": "sm_90a" if v.path != "large" else "sm_90"}, v


def test_the_device_decides_the_path():
    """16-bit at HEAD_DIM 64: mma.sync without Hopper's paths, wgmma (the forward: warp-specialized) with them;
    on a device with the large shared memory alone (Hopper with CUPYFLASH_NO_WGMMA=1) the mma.sync kernels
    too. The warp-specialized forward serves head dims 33-256 at its HEAD_DIMs 64, 128 and 256 (96 at 128, 160
    and 192 at 256, padded); 32 and below keep the wgmma forward."""
    for direction in ("fwd", "bwd"):
        assert _chosen(direction, head_dim=64, device=AMPERE).path == "mma"
        assert _chosen(direction, head_dim=64, device=LARGE_SMEM_ONLY).path == "mma"
    assert _chosen("bwd", head_dim=64, device=HOPPER).path == "wgmma"
    assert _chosen("probs", head_dim=64, causal=False, device=HOPPER).path == "wgmma"
    for head_dim, ws in (
        (33, 64),
        (64, 64),
        (65, 128),
        (96, 128),
        (128, 128),
        (129, 192),
        (192, 192),
        (193, 256),
        (256, 256),
    ):
        chosen = _chosen("fwd", head_dim=head_dim, device=HOPPER)
        assert (chosen.path, chosen.head_dim) == ("ws", ws), head_dim
    for head_dim in (16, 32):
        assert _chosen("fwd", head_dim=head_dim, device=HOPPER).path == "wgmma"
    assert [tiles.ws_head_dim(d) for d in (1, 32, 33, 64, 65, 128, 129, 256, 257)] == [
        None,
        None,
        64,
        64,
        128,
        128,
        192,
        256,
        None,
    ]
    assert [tiles.ws_head_dim(d, "bwd") for d in (32, 33, 96, 128, 129, 160, 161, 192, 193, 256)] == [
        None,
        64,
        128,
        128,
        None,
        None,
        192,
        192,
        256,
        256,
    ]


# ------------------------------------------------------------------------------------------ warp-specialized
def _fake_cupy(device=0):
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: device)))


def test_the_warp_specialized_forward_serves_plain_causal_and_scalar_modifiers_where_listed(monkeypatch):
    """At the head dims of the table's ws rows the 16-bit plain, causal, window-alone and scalar-modifier
    (window, softcap, ALiBi) forwards of dense batches on Hopper are the warp-specialized kernel: its name (the
    scalars as Mods::dense_scalars, bounded for a bfloat16 softcap without ALiBi, its ALiBi forms wherever
    there are slopes), three warpgroups owning 128 rows, its persistent grid (one CTA per SM, at most one per
    tile), its shared memory within an sm_90 CTA's 227 KiB. Backwards, dropout, float32, the modifiers'
    arrays, packed batches, other head dims and the mma.sync path are not. Each is shipped, and so is the
    wgmma forward it stands in for."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "cupy", _fake_cupy())
    assert tiles.WS_HEAD_DIMS
    window, softcap = dict(window=(10, 0)), dict(softcap=20.0)
    scalars = dict(softcap=20.0, window=(50, 3), alibi_slopes=SLOPES)
    for dtype, ctype in HALVES:
        for head_dim in _wgmma_head_dims():
            listed = tiles.ws_head_dim(head_dim) is not None
            # (causal as the kernel takes it, its Mods, the options, the variant chosen)
            forwards = [
                (causal, "Mods::none", {}, _chosen(dtype=dtype, head_dim=head_dim, causal=causal))
                for causal in (False, True)
            ]
            forwards += [
                (False, mods, options, _chosen(dtype=dtype, head_dim=head_dim, **options))
                for mods, options in (
                    ("Mods::window", window),
                    ("Mods::dense_scalars", softcap),
                    ("Mods::dense_scalars", scalars),
                )
            ]
            assert all((chosen.path == "ws") == listed for *_, chosen in forwards), head_dim
            assert all(chosen.path in ("ws", "wgmma") for *_, chosen in forwards), head_dim
            for options in (window, {}, softcap):
                assert _chosen("bwd", dtype, head_dim, **options).path == "wgmma"
            assert _chosen(dtype=dtype, head_dim=head_dim, bias=np.zeros((100, 120), dtype)).path == "wgmma"
            assert _chosen(dtype=dtype, head_dim=head_dim, packed=True, **softcap).path == "wgmma"
            assert _chosen(dtype=dtype, head_dim=head_dim, dropout=DROPOUT).path == "wgmma"
            if not listed:
                continue
            ws_dim = tiles.ws_head_dim(head_dim)  # 96 at 128, 160 and 192 at 256
            for causal, mods, options, chosen in forwards:
                t = chosen.tiles("fwd")
                assert chosen.head_dim == ws_dim and t == tiles.lookup("ws", 2, ws_dim, "fwd", chosen.form)
                assert chosen.name_expression("fwd") == (
                    f"attention_fwd_ws_kernel<{ctype}, {ws_dim}, {t.block}, {t.stages}, {_bool(causal)}, {mods}, "
                    f"{_bool(chosen.score == 'bounded')}, {_bool(chosen.score.startswith('alibi'))}, "
                    f"{_bool(chosen.score == 'alibi_half_first')}, false, {_bool(t.pack_after_wait)}, "
                    f"{_bool(t.store_warps)}, {ctype}, {t.rows // tiles.WS_WARPGROUP_ROWS}, 0, false>"
                )
                assert chosen.threads("fwd") == (t.rows // tiles.WS_WARPGROUP_ROWS + 1) * 128 and t.rows in (128, 192)
                assert t.copy_warps == tiles.WS_COPY_WARPS
                for rows, batch in ((1000, 3), (8192, 32), (1, 1)):
                    grid, block_shape, smem = launch.launch_shape(chosen, "fwd", rows, batch)
                    ctas = min(132, -(-rows // t.rows) * batch)  # a CTA per SM, at most one per tile
                    assert (grid, block_shape, smem) == ((ctas, 1, 1), (chosen.threads("fwd"),), chosen.smem("fwd"))
                assert chosen.smem("fwd") + 1024 <= 227 * 1024
                assert "attention_fwd_ws_kernel" in chosen.code()
                assert chosen in SHIPPED_SET and not chosen.block_mask
                assert (
                    dataclasses.replace(chosen, path="wgmma", score="bounded" if chosen.score == "bounded" else "plain")
                    in SHIPPED_SET
                )
                assert (chosen.score == "bounded") == (options is softcap and ctype == "bfloat16_t")
                assert chosen.score.startswith("alibi") == (options is scalars)
                # scalars' window (50, 3): a right edge, so ALiBi's half-width first block
                assert (chosen.score == "alibi_half_first") == (options is scalars)
                # ALiBi's half-width first block where the window has a right edge (causal or not), only there
                for window_, causal_, half in (
                    ((-1, -1), False, False),
                    ((-1, -1), True, True),
                    ((50, 3), False, True),
                    ((50, -1), False, False),
                    ((50, -1), True, True),
                ):
                    alibi = _chosen(dtype=dtype, head_dim=head_dim, causal=causal_, window=window_, alibi_slopes=SLOPES)
                    assert alibi.path == "ws" and alibi.score == ("alibi_half_first" if half else "alibi"), window_
                    assert alibi in SHIPPED_SET
    assert _chosen(dtype=np.float32).path == "pieces"
    assert _chosen(device=AMPERE, window=(10, 0)).path == "mma"
    assert _chosen(device=AMPERE).path == "mma"
    ws = [v for v in SHIPPED if v.path == "ws" and v.dtype != FP8 and not v.fused_backward]  # FP8: test_fp8_variants
    assert ws and all(
        v.direction == "fwd"
        and v.itemsize == 2
        and not v.dropout
        and v.head_dim in tiles.WS_HEAD_DIMS
        and v.mods in ("none", "scalars", "window")
        for v in ws
    )
    assert {(v.dtype, v.head_dim) for v in ws if v.score.startswith("alibi")} == {
        (d, h) for d in ("float16", "bfloat16") for h in tiles.WS_HEAD_DIMS
    }
    assert all(v.mods == "scalars" for v in ws if v.score != "plain")
    assert not any(v.score.startswith("alibi") for v in SHIPPED if v.path != "ws"), "ALiBi's forms are ws only"
    assert {v for v in ws if v.score == "alibi_half_first"} == {
        dataclasses.replace(v, score="alibi_half_first") for v in ws if v.score == "alibi"
    }


def test_where_tma_cannot_read_the_inputs_the_wgmma_forward_serves():
    """attention_forward asks again with tma=False when tensor maps cannot describe q, k, v (a broadcast
    batch dim) or the block mask has more key tiles than the walk holds: the wgmma forward of the same form."""
    for options in ({}, dict(window=(10, 0)), dict(softcap=20.0), dict(alibi_slopes=SLOPES), dict(block_mask=ON)):
        for dtype, _ in HALVES:
            ws = _chosen(dtype=dtype, **options)
            fallback = _chosen(dtype=dtype, tma_ok=False, **options)
            assert ws.path == "ws" and fallback.path == "wgmma", options
            assert fallback.mods == ("all" if "block_mask" in options else ws.mods), options
            assert fallback.score == ("bounded" if ws.score == "bounded" else "plain")
            assert fallback in SHIPPED_SET and not fallback.block_mask


def test_ctas_per_sm_fit_the_shared_memory_of_an_sm():
    """Only the wgmma forward takes ctas_per_sm (its launch bounds), and a kernel compiled for n CTAs per SM
    must also leave room for them in shared memory: n times its dynamic shared memory, its static (under
    1 KiB: the block-mask bitmap and a few words) and the 1 KiB the hardware reserves per CTA, within
    Hopper's 228 KiB per SM (the registers are ptxas' part of the bound: tests/tooling/test_compile.py checks
    that nothing spills)."""
    checked = 0
    for variant in SHIPPED:
        for kernel in variant.kernels:
            if kernel == "preprocess" or variant.tiles(kernel).ctas_per_sm == 1:
                continue
            ctas = variant.tiles(kernel).ctas_per_sm
            assert kernel == "fwd" and variant.path == "wgmma", (variant, kernel)
            assert ctas * (variant.smem(kernel) + 2048) <= 228 * 1024, (variant, kernel)
            checked += 1
    cells = [key for key, t in tiles.CELLS.items() if t.ctas_per_sm > 1]
    assert checked == 2 * len(cells) and cells  # each such cell's forward, float16 and bfloat16


def test_a_block_mask_forward_walks_it_on_the_warp_specialized_kernel():
    """A 16-bit forward at a ws head dim whose only array is a block mask (with or without the scalar
    modifiers) runs the warp-specialized kernel's BLOCK_MASK form (Mods::dense_scalars; bounded, ALiBi and
    half-first forms as without the mask); with a bias or a mask, dropout, a packed batch, another head dim,
    float32, the mma.sync path or tma=False (attention_forward: TMA cannot read the inputs, or more key tiles
    than the walk holds) it takes Mods::all. Its backward is the scalars' passes either way."""
    for dtype, ctype in HALVES:
        for causal, options, bounded, alibi, half in (
            (False, {}, False, False, False),
            (True, {}, False, False, False),
            (True, dict(window=(200, 0)), False, False, False),
            (False, dict(softcap=20.0), ctype == "bfloat16_t", False, False),
            (True, dict(alibi_slopes=SLOPES), False, True, True),
            (False, dict(alibi_slopes=SLOPES), False, True, False),
        ):
            chosen = _chosen(dtype=dtype, causal=causal, block_mask=ON, **options)
            assert chosen.block_mask and chosen.path == "ws" and chosen.mods == "scalars" and not chosen.causal
            score = "bounded" if bounded else "alibi_half_first" if half else "alibi" if alibi else "plain"
            assert chosen.score == score, options
            t = chosen.tiles("fwd")
            assert chosen.name_expression("fwd") == (
                f"attention_fwd_ws_kernel<{ctype}, 128, {t.block}, {t.stages}, false, Mods::dense_scalars, "
                f"{_bool(bounded)}, {_bool(alibi)}, {_bool(half)}, true, {_bool(t.pack_after_wait)}, "
                f"{_bool(t.store_warps)}, {ctype}, 2, 0, false>"
            ), options
            assert chosen in SHIPPED_SET
            assert dataclasses.replace(chosen, block_mask=False) in SHIPPED_SET  # the same form without the walk
            backward = _chosen("bwd", dtype, causal=causal, block_mask=ON, **options)
            assert backward.mods == "scalars" and not backward.block_mask
            assert "Mods::scalars" in backward.name_expression("dq")
    full = [
        _chosen(block_mask=ON, bias=np.zeros((100, 120), np.float16)),
        _chosen(block_mask=ON, mask=np.ones((100, 120), bool)),
        _chosen(block_mask=ON, dropout=DROPOUT),
        _chosen(block_mask=ON, packed=True),
        _chosen(dtype=np.float32, block_mask=ON),
        _chosen(head_dim=256, block_mask=ON),  # 64-key blocks: not the mask's tiles
        _chosen(block_mask=ON, tma_ok=False),
        _chosen(block_mask=ON, device=AMPERE),
    ]
    for chosen in full:
        assert not chosen.block_mask and chosen.path != "ws" and "Mods::all" in chosen.name_expression("fwd"), chosen
    assert {v for v in SHIPPED if v.block_mask} == {
        dataclasses.replace(v, block_mask=True)
        for v in SHIPPED
        if v.path == "ws" and v.mods == "scalars" and v.tiles("fwd").block == 128 and not v.wide
    }  # key blocks: the mask's tiles (unrounded results: the walk is not shipped)


def test_the_warp_specialized_block_mask_walk_holds_2048_key_tiles(monkeypatch):
    """The kernel's walk keeps a tile's key blocks as bits in shared memory (TILE_BITMAP_WORDS words of 32);
    attention_forward sends a longer key axis to Mods::all (dense._tma_reads says no)."""
    words = int(re.search(r"constexpr int TILE_BITMAP_WORDS = (\d+);", source("block_mask.cuh")).group(1))
    assert tiles.WS_BLOCK_MASK_TILES == 32 * words == 2048
    monkeypatch.setattr(tma, "available", lambda: True)
    monkeypatch.setattr(tma, "describable", lambda array, sizes, strides, broadcast=False: True)
    walk = Variant("fwd", "float16", 128, "ws", "scalars", block_mask=True)
    arrays = {name: None for name in ("q", "k", "v")}
    strides = {name: [0, 0, 0] for name in arrays}
    assert dense._tma_reads(walk, arrays, [1, 1, 1], strides, 2048 * 128)
    assert not dense._tma_reads(walk, arrays, [1, 1, 1], strides, 2048 * 128 + 1)
    assert dense._tma_reads(dataclasses.replace(walk, block_mask=False), arrays, [1, 1, 1], strides, 10**7)
    monkeypatch.setattr(tma, "describable", lambda array, sizes, strides, broadcast=False: False)
    assert not dense._tma_reads(walk, arrays, [1, 1, 1], strides, 128)


def test_k_and_v_broadcast_over_query_heads_take_the_warp_specialized_forward(monkeypatch):
    """GQA's layout, k and v of shape (B, Hk, 1, N, D) against q's (B, Hk, G, N, D): tensor maps describe them (the
    group dim one entry, read at coordinate 0), so dense._tma_reads says yes, as long as k and v are broadcast over
    the same dims (the kernel reads both at k's coordinates); q broadcast stays with the wgmma forward."""
    monkeypatch.setattr(tma, "available", lambda: True)

    def array(shape, strides):
        return types.SimpleNamespace(
            shape=shape, strides=strides, dtype=np.dtype(np.float16), data=types.SimpleNamespace(ptr=1 << 20)
        )

    plain = Variant("fwd", "float16", 128, "ws", "none")
    sizes = [2, 4, 3]
    own = [4 * 3 * 100 * 128, 3 * 100 * 128, 100 * 128]
    shared = [4 * 100 * 128, 100 * 128, 0]
    q = array((2, 4, 3, 100, 128), tuple(2 * s for s in own) + (256, 2))
    kv = array((2, 4, 1, 100, 128), tuple(2 * s for s in shared) + (256, 2))
    arrays = {"q": q, "k": kv, "v": kv}
    assert dense._tma_reads(plain, arrays, sizes, {"q": own, "k": shared, "v": shared}, 100)
    assert not dense._tma_reads(plain, arrays, sizes, {"q": own, "k": shared, "v": own}, 100)  # v not broadcast
    assert not dense._tma_reads(plain, arrays, sizes, {"q": shared, "k": shared, "v": shared}, 100)  # q broadcast


def test_k_and_v_broadcast_over_query_heads_take_the_fused_backward(monkeypatch):
    """fused_backward.describable: k and v broadcast over batch dims (GQA, MQA), over the same dims or not (the
    kernel works each one's coordinates out from its own strides), are read through tensor maps; q or dout
    broadcast are not (the two passes serve them)."""
    monkeypatch.setattr(tma, "available", lambda: True)

    def array(shape, strides):
        return types.SimpleNamespace(
            shape=shape, strides=strides, dtype=np.dtype(np.float16), data=types.SimpleNamespace(ptr=1 << 20)
        )

    sizes = [2, 4, 3]
    own = [4 * 3 * 100 * 128, 3 * 100 * 128, 100 * 128]
    shared = [4 * 100 * 128, 100 * 128, 0]
    full = array((2, 4, 3, 100, 128), tuple(2 * s for s in own) + (256, 2))
    kv = array((2, 4, 1, 100, 128), tuple(2 * s for s in shared) + (256, 2))
    arrays = {"q": full, "k": kv, "v": kv, "dout": full}
    assert fused_backward.describable(arrays, sizes, {"q": own, "k": shared, "v": shared, "dout": own})
    assert fused_backward.describable(arrays, sizes, {"q": own, "k": shared, "v": own, "dout": own})
    assert not fused_backward.describable(arrays, sizes, {"q": shared, "k": own, "v": own, "dout": own})
    assert not fused_backward.describable(arrays, sizes, {"q": own, "k": own, "v": own, "dout": shared})


def test_softcapped_bfloat16_without_alibi_takes_the_bounded_forward():
    """On Hopper the bfloat16 forward with a softcap of at most BOUNDED_SOFTCAP_MAX and no ALiBi (window or
    not) takes 1 as every row's max, in the warp-specialized forward too (and in the one it falls back to);
    anything else keeps the row max."""
    limit = BOUNDED_SOFTCAP_MAX
    assert 42.9 < limit < 43.0  # 62 ln 2: exp2(-2 * 62) stays a normal float
    for options in (dict(softcap=2.0), dict(softcap=limit), dict(softcap=30.0, window=(10, 0))):
        for head_dim in (64, 128):
            chosen = _chosen(dtype=BF16, head_dim=head_dim, **options)
            assert chosen.score == "bounded" and chosen.mods == "scalars", options
            assert chosen.path == ("ws" if head_dim in tiles.WS_HEAD_DIMS else "wgmma")
            if chosen.path == "ws":
                t = chosen.tiles("fwd")
                expected = (
                    f"Mods::dense_scalars, true, false, false, false, {_bool(t.pack_after_wait)}, "
                    f"{_bool(t.store_warps)}, bfloat16_t, {t.rows // tiles.WS_WARPGROUP_ROWS}, 0, false>"
                )
            else:
                expected = "Mods::scalars, false, true, 1>"
            assert chosen.name_expression("fwd").endswith(expected), chosen.name_expression("fwd")
            assert chosen in SHIPPED_SET and dataclasses.replace(chosen, path="wgmma") in SHIPPED_SET
    assert _chosen(dtype=BF16, softcap=float(np.nextafter(limit, np.inf))).score != "bounded"
    assert _chosen(dtype=BF16, softcap=50.0).score != "bounded"
    assert _chosen(dtype=BF16, softcap=30.0, alibi_slopes=SLOPES).score != "bounded"
    assert _chosen(dtype=BF16, window=(10, 0)).score != "bounded"
    assert _chosen(dtype=np.float16, softcap=30.0).score != "bounded"
    assert _chosen("bwd", BF16, softcap=30.0).score != "bounded"
    assert _chosen(dtype=BF16, softcap=30.0, dropout=DROPOUT).score != "bounded"
    assert _chosen(dtype=BF16, softcap=30.0, bias=np.zeros((100, 120), BF16)).score != "bounded"
    assert _chosen(dtype=BF16, softcap=30.0, device=AMPERE).score != "bounded"  # mma.sync has no bounded form
    assert all(
        v.dtype == "bfloat16" and v.direction == "fwd" and v.path in ("wgmma", "ws")
        for v in SHIPPED
        if v.score == "bounded"
    )


def test_fp8_variants():
    """The FP8 forward: e4m3 inputs on the warp-specialized path at the table's 1-byte HEAD_DIMs, plain and
    causal, out in bfloat16 or float16."""
    fp8 = [v for v in SHIPPED if v.dtype == FP8]
    assert tiles.FP8_HEAD_DIMS == (64, 128, 256)
    assert {(v.head_dim, v.causal, v.out_dtype) for v in fp8} == {
        (h, c, o) for h in tiles.FP8_HEAD_DIMS for c in (False, True) for o in ("bfloat16", "float16")
    }
    for v in fp8:
        assert v.path == "ws" and v.direction == "fwd" and v.mods == "none" and v.itemsize == 1
        name = v.name_expression("fwd")
        assert name.startswith(f"attention_fwd_ws_kernel<e4m3_t, {v.head_dim}, ")
        # then out's type, the computing warpgroups (three at HEAD_DIM 64), P V's chunks and S_FIRST (its P V
        # apart from S's product at HEAD_DIM 256, whose registers hold no second accumulator beside S's)
        t = v.tiles("fwd")
        warpgroups = t.rows // tiles.WS_WARPGROUP_ROWS
        assert warpgroups == (3 if v.head_dim == 64 else 2)
        assert t.scores_first == (v.head_dim == 256)
        out = {"bfloat16": "bfloat16_t", "float16": "half_t"}[v.out_dtype]
        assert name.endswith(f", {out}, {warpgroups}, {t.pv_cols}, {'true' if t.scores_first else 'false'}>")
        assert v.compile_targets() == {"sm_90": "sm_90a"}


# ------------------------------------------------------------------------------------------ the fused backward
def _backward(
    lengths,
    dtype=ml_dtypes.bfloat16,
    head_dim=128,
    causal=True,
    device=HOPPER,
    dropout=None,
    dv=None,
    packed=False,
    tma_ok=True,
    deterministic=True,
    **options,
):
    mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, **options) if options else None
    features = Features.of(
        "bwd",
        np.dtype(dtype),
        head_dim,
        head_dim if dv is None else dv,
        causal,
        mods,
        dropout,
        packed,
        lengths=lengths,
        deterministic=deterministic,
    )
    return tile_policy.dense(dataclasses.replace(features, tma=tma_ok), device)


def test_the_fused_backward_serves_long_plain_and_causal_16_bit_calls_on_hopper(monkeypatch):
    """16-bit dense backwards on Hopper at head dims 33-128 and 161-256, plain or causal, from the table's
    shortest length (the shorter of Nq, Nk) to CHAIN_ROWS: the fused kernel, its three kernels named from the
    table's cell (always the ordered adds by default), a CTA per 128 keys (64 at HEAD_DIM 192 and 256, where its
    two consumers pair up) and its conversion per query block, shared memory within 227 KiB. Shorter or longer
    calls, score modifiers, dropout, packed batches, float32, inputs TMA cannot read, other head dims and the
    mma.sync path take the two passes."""
    monkeypatch.setattr(launch, "cupy", _fake_cupy())
    assert tiles.WS_BWD_HEAD_DIMS == (64, 128, 192, 256) and set(tile_policy.WS_BWD_MIN_LENGTH) == set(
        tiles.WS_BWD_HEAD_DIMS
    )
    for dtype, ctype in HALVES:
        for d, head_dim in ((40, 64), (64, 64), (100, 128), (128, 128), (168, 192), (192, 192), (200, 256), (256, 256)):
            shortest = tile_policy.WS_BWD_MIN_LENGTH[head_dim]
            for causal in (False, True):
                v = _backward((shortest, shortest + 1), dtype, d, causal)
                assert v.fused_backward and v == Variant("bwd", np.dtype(dtype).name, head_dim, "ws", causal=causal)
                assert v in SHIPPED_SET and v.kernels == ("preprocess", "bwd", "dq_convert")
                t = v.tiles("bwd")
                assert t == v.tiles("dq_convert") == tiles.lookup("ws", 2, head_dim, "bwd", "plain")
                chains = tiles.ws_bwd_dq_chains(t)
                assert t.paired == (head_dim > 128) and t.rows == (64 if t.paired else 128)
                assert chains == {64: 2, 128: 1, 192: 2, 256: 2}[head_dim]
                paired = _bool(t.paired)
                assert v.name_expression("bwd") == (
                    f"attention_bwd_ws_kernel<{ctype}, {head_dim}, {t.block}, "
                    f"{t.stages}, {_bool(causal)}, true, {chains}, {paired}, {ctype}>"
                )
                assert v.name_expression("dq_convert") == (
                    f"attention_bwd_dq_convert_kernel<{ctype}, {head_dim}, "
                    f"{t.block}, {_bool(causal)}, {chains}, {paired}, {ctype}>"
                )
                assert "attention_bwd_ws_kernel" in v.code(("bwd", "dq_convert"))
                assert "attention_bwd_preprocess_kernel" in v.code(("preprocess",))
                assert launch.launch_shape(v, "bwd", 1000, 6) == ((-(-1000 // t.rows), 6, 1), (384,), v.smem("bwd"))
                assert launch.launch_shape(v, "dq_convert", 1000, 6) == ((-(-1000 // t.block), 6, 1), (256,), 0)
                assert v.smem("bwd") <= 227 * 1024
                # the two passes of the same call
                table_dim = min(h for h in tiles.HEAD_DIMS if h >= d)  # the two passes' own HEAD_DIM
                two_passes = Variant("bwd", np.dtype(dtype).name, table_dim, "wgmma", causal=causal)
                for lengths in ((shortest - 1, shortest), (shortest, shortest - 1), (tiles.CHAIN_ROWS + 1, shortest)):
                    assert _backward(lengths, dtype, d, causal) == two_passes, lengths
                assert _backward((shortest, shortest), dtype, d, causal, tma_ok=False) == two_passes
                assert _backward((shortest, shortest), dtype, d, causal, device=AMPERE).path == "mma"
                assert _backward((shortest, shortest), dtype, d, causal, dropout=DROPOUT).path == "wgmma"
                assert _backward((shortest, shortest), dtype, d, causal, packed=True).path == "wgmma"
            for options in (dict(window=(10, 0)), dict(softcap=5.0), dict(alibi_slopes=SLOPES)):
                assert _backward((shortest, shortest), dtype, d, False, **options).path == "wgmma", options
    assert _backward((1 << 16, 1 << 16), head_dim=32).path == "wgmma"
    for head_dim, ws_dim in ((33, 64), (96, 128), (161, 192), (193, 256)):  # padded to its HEAD_DIM
        chosen = _backward((1 << 16, 1 << 16), head_dim=head_dim)
        assert (chosen.path, chosen.head_dim, chosen.fused_backward) == ("ws", ws_dim, True), head_dim
    for head_dim in (129, 160):  # the two passes at the table's HEAD_DIM 160
        assert _backward((1 << 16, 1 << 16), head_dim=head_dim) == Variant("bwd", "bfloat16", 160, "wgmma", causal=True)
    assert _backward((1 << 16, 1 << 16), dtype=np.float32).path == "pieces"
    assert _backward((1 << 16, 1 << 16), dtype=np.float64).path != "ws"
    assert not _backward((0, 0)).fused_backward  # lengths not given: the two passes


def test_unordered_adds_take_the_fused_backward_from_the_same_shortest_length():
    """deterministic=False: the fused backward with unordered dq adds (its kernel's DETERMINISTIC false), from
    WS_BWD_MIN_LENGTH as in order; every other call keeps its variant, deterministic whatever was asked."""
    for dtype, ctype in HALVES:
        for head_dim in tiles.WS_BWD_HEAD_DIMS:
            for causal in (False, True):
                shortest = tile_policy.WS_BWD_MIN_LENGTH[head_dim]
                assert _backward((shortest, shortest), dtype, head_dim, causal).fused_backward
                v = _backward((shortest, shortest), dtype, head_dim, causal, deterministic=False)
                assert v == Variant("bwd", np.dtype(dtype).name, head_dim, "ws", causal=causal, deterministic=False)
                assert v in SHIPPED_SET and "unordered dq adds" in str(v)
                t = v.tiles("bwd")
                # unordered adds go into one accumulator: one chain, for the kernel and its conversion
                paired = _bool(t.paired)
                assert v.name_expression("bwd") == (
                    f"attention_bwd_ws_kernel<{ctype}, {head_dim}, {t.block}, "
                    f"{t.stages}, {_bool(causal)}, false, 1, {paired}, {ctype}>"
                )
                assert (
                    v.name_expression("dq_convert")
                    == f"attention_bwd_dq_convert_kernel<{ctype}, {head_dim}, {t.block}, {_bool(causal)}, 1, {paired}, "
                    f"{ctype}>"
                )
                shorter = _backward((shortest - 1, shortest), dtype, head_dim, causal, deterministic=False)
                assert shorter == Variant("bwd", np.dtype(dtype).name, head_dim, "wgmma", causal=causal)
                assert shorter.deterministic
    # shorter, an ordered or unordered call keeps the two passes
    n = tile_policy.WS_BWD_MIN_LENGTH[128]
    for deterministic in (True, False):
        assert _backward((n - 1, n - 1), causal=False, deterministic=deterministic).path == "wgmma"
    for options in (dict(softcap=5.0), dict(window=(10, 0))):
        assert _backward((1 << 14, 1 << 14), causal=False, deterministic=False, **options).deterministic
    assert _backward((1 << 14, 1 << 14), causal=False, deterministic=False, device=AMPERE).deterministic


def test_fused_backward_adds_by_arrival_where_an_entry_fits_and_short_of_the_index_order_lengths():
    """The fused backward's order of dq adds: by arrival only where a batch entry's key blocks (of 128 keys, or 64
    paired) fit on the SMs at once; without a causal mask, from WS_BWD_INDEX_ORDER_KEYS keys on, by index."""
    from cupyflash._cuda import tile_policy

    assert set(tile_policy.WS_BWD_INDEX_ORDER_KEYS) == set(tiles.WS_BWD_HEAD_DIMS)
    for head_dim, longest in tile_policy.WS_BWD_INDEX_ORDER_KEYS.items():
        keys = tiles.lookup("ws", 2, head_dim, "bwd", "plain").rows
        for sms in (1000, 2000):
            assert tile_policy.fused_backward_by_arrival(longest - 1, head_dim, False, sms, keys=keys)
            assert not tile_policy.fused_backward_by_arrival(longest, head_dim, False, sms, keys=keys)
            assert tile_policy.fused_backward_by_arrival(longest, head_dim, True, sms, keys=keys)
        assert tile_policy.fused_backward_by_arrival(132 * keys, head_dim, True, 132, keys=keys)
        assert not tile_policy.fused_backward_by_arrival(
            132 * keys + 1, head_dim, True, 132, keys=keys
        )  # 133 key blocks on 132 SMs
        assert not tile_policy.fused_backward_by_arrival(
            7 * keys + 1, head_dim, False, 7, keys=keys
        )  # 8 key blocks on 7 SMs
        # Unordered adds wait for nothing: by arrival at any length, on any GPU.
        for nk, causal, sms in ((1 << 20, False, 132), (1000, False, 7), (longest, False, 132), (1 << 20, True, 1)):
            assert tile_policy.fused_backward_by_arrival(nk, head_dim, causal, sms, deterministic=False, keys=keys)
        assert tile_policy.fused_backward_by_arrival(8 * keys, head_dim, True, 8, keys=keys)


def test_backward_lengths_keep_calls_with_little_work_on_the_two_passes():
    """The backward's Features carry (Nq, Nk) only where batch x Nq x Nk x HEAD_DIM reaches WS_BWD_MIN_WORK: a
    long sequence in one or two heads stays on the planned two passes (host time), the same in 64 heads not."""
    n = 4096
    assert n >= tile_policy.WS_BWD_MIN_LENGTH[128]
    assert tile_policy.backward_lengths(64, n, n, 128) == (n, n)
    assert tile_policy.backward_lengths(1, n, n, 128) == (0, 0)
    assert tile_policy.backward_lengths(1, 1 << 17, 1 << 17, 128) == (1 << 17, 1 << 17)
    least = next(b for b in range(1, 1 << 20) if b * n * n * 128 >= tile_policy.WS_BWD_MIN_WORK)
    assert tile_policy.backward_lengths(least, n, n + 3, 128) == (n, n + 3) and tile_policy.backward_lengths(
        least - 1, n, n, 128
    ) == (0, 0)
    assert _backward(tile_policy.backward_lengths(least - 1, n, n, 128)).path == "wgmma"
    assert _backward(tile_policy.backward_lengths(least, n, n, 128)).fused_backward


# ------------------------------------------------------------------------------------------ unrounded results
def _features(direction, dtype, head_dim, causal, dropout=None, packed=False, lengths=(0, 0), **options):
    mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, **options) if options else None
    return Features.of(direction, np.dtype(dtype), head_dim, head_dim, causal, mods, dropout, packed, lengths=lengths)


WIDE_OPTIONS = (
    {},
    dict(window=(40, 0)),
    dict(window=(40, 10), softcap=20.0),
    dict(softcap=20.0),
    dict(alibi_slopes=SLOPES),
    dict(bias=np.zeros((100, 120), np.float32)),
    dict(mask=np.ones((100, 120), bool)),
    dict(block_mask=ON),
)


def test_float32_results_of_16_bit_inputs_take_a_shipped_unrounded_variant():
    """Whatever the options, path and head dim, a call asking for float32 results of 16-bit inputs gets a shipped
    variant that stores float32, at a HEAD_DIM that holds its head dim; its kernels are the rounded call's where
    those ship unrounded."""
    for dtype, _ in HALVES:
        for head_dim in (8, 40, 64, 96, 128, 160, 200, 256):
            for device in (HOPPER, AMPERE):
                for direction in ("fwd", "bwd"):
                    for causal in (False, True):
                        for options in WIDE_OPTIONS:
                            for extra in (dict(), dict(dropout=DROPOUT), dict(packed=True)):
                                if extra.get("packed") and set(options) & {"bias", "mask", "block_mask"}:
                                    continue
                                f = _features(direction, dtype, head_dim, causal, **extra, **options)
                                wide = dataclasses.replace(f, out_dtype="float32")
                                for tma_ok in (True, False):
                                    chosen = tile_policy.dense(dataclasses.replace(wide, tma=tma_ok), device)
                                    assert chosen.wide and chosen in SHIPPED_SET, (f, chosen)
                                    assert chosen.head_dim >= head_dim and chosen.head_dim in tile_policy.WIDE_HEAD_DIMS
                                    rounded = tile_policy.dense(dataclasses.replace(f, tma=tma_ok), device)
                                    same = dataclasses.replace(rounded, out_dtype="float32")
                                    if same in SHIPPED_SET and rounded.head_dim == chosen.head_dim:
                                        assert chosen == same, (f, chosen, rounded)


def test_the_rings_calls_keep_their_kernels_with_unrounded_results():
    """Plain, causal and windowed calls of the ring's 16-bit blocks take the kernels of the rounded call, with float32
    results: the warp-specialized forward, the fused backward at long lengths, the two passes below them."""
    for dtype, _ in HALVES:
        for head_dim in tile_policy.WIDE_HEAD_DIMS:
            for causal in (False, True):
                for options in ({}, dict(window=(200, 0))):
                    for direction, lengths in (("fwd", (0, 0)), ("bwd", (0, 0)), ("bwd", (16384, 16384))):
                        f = _features(direction, dtype, head_dim, causal, lengths=lengths, **options)
                        rounded = tile_policy.dense(f, HOPPER)
                        chosen = tile_policy.dense(dataclasses.replace(f, out_dtype="float32"), HOPPER)
                        if direction == "bwd" and options:  # a window alone's backward: the scalars' passes
                            assert rounded.mods == "window" and chosen.path == rounded.path, chosen
                            assert chosen == dataclasses.replace(rounded, mods="scalars", out_dtype="float32")
                            continue
                        assert chosen == dataclasses.replace(rounded, out_dtype="float32"), (f, chosen)
                        assert chosen.path == ("ws" if direction == "fwd" or lengths[0] else "wgmma")
                        assert chosen.results == "float"


def test_unrounded_results_fall_back_to_the_forms_that_ship():
    """Where the rounded call's form does not ship unrounded, the call runs on a form that does: a window or softcap
    alone on the scalars, dropout alone on all+dropout, the warp-specialized ALiBi and block-mask walk on the wgmma
    forward, the unordered fused backward in order, the bounded softcap's scores as plain ones."""

    def wide(direction="fwd", dtype=BF16, causal=True, **options):
        f = _features(direction, dtype, 128, causal, **options)
        return tile_policy.dense(dataclasses.replace(f, out_dtype="float32"), HOPPER)

    assert wide("bwd", window=(40, 0)).mods == "scalars"
    assert wide("bwd", softcap=20.0).mods == "scalars"
    assert wide(softcap=20.0).score == "plain" and wide(softcap=20.0).path == "ws"
    assert wide(dropout=DROPOUT).mods == "all" and wide(dropout=DROPOUT).dropout
    assert not wide(dropout=DROPOUT).causal  # causal travels as the window's right edge
    assert wide(alibi_slopes=SLOPES).path == "wgmma" and wide(alibi_slopes=SLOPES).mods == "scalars"
    walked = wide(block_mask=ON)
    assert walked.path == "wgmma" and walked.mods == "all" and not walked.block_mask
    f = _features("bwd", BF16, 128, True, lengths=(16384, 16384))
    unordered = dataclasses.replace(f, deterministic=False, out_dtype="float32")
    assert tile_policy.dense(unordered, HOPPER) == Variant(
        "bwd", "bfloat16", 128, "ws", causal=True, out_dtype="float32"
    )


def test_results_in_the_inputs_dtype_or_float32_for_float32_inputs_are_not_wide():
    for dtype in (np.float16, BF16, np.float32, np.float64):
        assert Features.of("fwd", np.dtype(dtype), 64, 64, False, results=np.dtype(dtype)).out_dtype == ""
        assert Features.of("fwd", np.dtype(dtype), 64, 64, False).out_dtype == ""
    assert Features.of("fwd", np.dtype(np.float16), 64, 64, False, results=np.float32).out_dtype == "float32"
    assert Features.of("bwd", BF16, 64, 64, False, results="float32").out_dtype == "float32"


def test_unrounded_variants_stay_a_fifth_of_the_catalogue():
    """Every form a wide call can take ships at every WIDE_HEAD_DIM for both 16-bit dtypes: 208 variants, a fifth
    more than the rounded catalogue's 907, not twice it."""
    wide = [v for v in SHIPPED if v.wide]
    assert len(wide) == len(tile_policy.wide_variants()) == 208
    assert len(SHIPPED) - len(wide) == 907
    assert {v.path for v in wide} == {"mma", "wgmma", "ws"}
    assert all(v.deterministic and not v.block_mask and v.score == "plain" for v in wide)


def test_summed_gradients_come_unrounded_only_on_the_rounded_calls_kernels(monkeypatch):
    """dense.unrounded_if_alike: a backward whose gradients are summed after it (GQA's dk, dv) writes them in
    float32 where the unrounded variant is the rounded one but for its results' type (plain and causal at head
    dims 33-64, 97-128 and 161-256, the scalars' form, in order, on the two passes or the fused backward), and keeps
    the 16-bit results where they would differ: padded head dims (1-32 at 64, 65-96 at 128, 129-160 at 192: at
    65-96 the fused backward is alike but the two passes it falls back to are not), Hopper's forms of a window or a
    softcap alone, dropout without modifiers, and the fused backward's unordered dq adds. float32 inputs and an
    explicit float32 keep their own dtype."""
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    for device in (HOPPER, AMPERE):
        monkeypatch.setattr(dense, "current_device", lambda device=device: device)

        def decided(head_dim=64, dtype=f16, grad_dtype=f16, lengths=(0, 0), deterministic=True, dropout=None, **opts):
            mods = _modifiers.resolve(np, dtype, (2, 3), 100, 120, **opts) if opts else None
            features = Features.of(
                "bwd", dtype, head_dim, head_dim, True, mods, dropout, lengths=lengths, deterministic=deterministic
            )
            return dense.unrounded_if_alike(features, dtype, grad_dtype)

        long = (16384, 16384)
        for head_dim in (40, 64, 100, 128, 170, 256):
            assert decided(head_dim) == f32, (device, head_dim)
            assert decided(head_dim, lengths=long) == f32, (device, head_dim)
        assert decided(head_dim=96) == decided(head_dim=96, lengths=long) == f16, device
        assert decided(head_dim=192, lengths=long) == f32, device
        assert decided(head_dim=32) == f16, device
        assert decided(head_dim=150) == f16, device
        alone = f16 if device.wgmma else f32  # Hopper's own forms for them; elsewhere the scalars serve both
        assert decided(window=(20, 0)) == alone, device
        assert decided(softcap=10.0) == alone, device
        assert decided(window=(20, 0), softcap=10.0, alibi_slopes=np.ones(3, np.float32)) == f32, device
        assert decided(dropout=_dropout.resolve(0.1, 3, caller="test")) == f16, device
        assert decided(dropout=_dropout.resolve(0.1, 3, caller="test"), window=(20, 0)) == f32, device
        assert decided(dtype=f32, grad_dtype=f32) == f32, device
        assert decided(grad_dtype=f32) == f32, device
    monkeypatch.setattr(dense, "current_device", lambda: HOPPER)
    features = Features.of("bwd", f16, 128, 128, True, lengths=(16384, 16384), deterministic=False)
    assert tile_policy.dense(features, HOPPER).deterministic is False  # the unordered fused backward
    assert dense.unrounded_if_alike(features, f16, f16) == f16
