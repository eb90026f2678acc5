"""Which kernel variant a call selects, and with which tiles (no GPU needed: selection only)."""

import dataclasses
import re
import ml_dtypes
import numpy as np
import pytest

from cupyflash import _config, _dropout, _kernels, _modifiers


def _mods(**options):
    return _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, **options)


def _variant(mods, dropout=None, direction="fwd"):
    return _kernels._variant(direction, np.float16, 64, 64, True, mods, dropout)


def test_window_softcap_and_alibi_take_the_scalars_instantiation(monkeypatch):
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: False)  # (a softcap alone: the test below)
    slopes = np.ones((3,), dtype=np.float32)
    for options in (dict(window=(10, 0)), dict(softcap=5.0), dict(alibi_slopes=slopes),
                    dict(window=(10, 5), softcap=5.0, alibi_slopes=slopes)):
        for direction in ("fwd", "bwd"):
            variant = _variant(_mods(**options), direction=direction)
            assert variant.mods and variant.scalar_mods and not variant.causal, options
            assert "Mods::scalars" in variant.name_expression(direction if direction == "fwd" else "dq")


def test_a_block_mask_takes_the_scalars_backward_and_the_full_forward():
    for options in (dict(block_mask=np.ones((1, 1), bool)), dict(window=(10, 5), softcap=5.0, block_mask=np.ones((1, 1), bool))):
        forward, backward = (_variant(_mods(**options), direction=direction) for direction in ("fwd", "bwd"))
        assert forward.mods and not forward.scalar_mods and "Mods::all" in forward.name_expression("fwd"), options
        assert backward.mods and backward.scalar_mods and "Mods::scalars" in backward.name_expression("dq"), options


def test_arrays_or_dropout_take_the_full_instantiation():
    arrays = dict(bias=np.zeros((100, 120), np.float16), mask=np.ones((100, 120), bool))
    for name, array in arrays.items():
        variant = _variant(_mods(window=(10, 0), block_mask=np.ones((1, 1), bool), **{name: array}))
        assert variant.mods and not variant.scalar_mods, name
        assert "Mods::all" in variant.name_expression("fwd")
    with_dropout = _variant(_mods(window=(10, 0)), _dropout.Dropout(0.1, 1))
    assert with_dropout.mods and with_dropout.dropout and not with_dropout.scalar_mods
    assert _kernels._variant("probs", np.float16, 64, 64, False, _mods(softcap=5.0)).scalar_mods is False
    float64 = _kernels._variant("fwd", np.float64, 64, 64, False, _mods(softcap=5.0))
    assert float64.mods and not float64.scalar_mods  # float64 has no scalars instantiation


def test_plain_calls_take_no_modifiers():
    variant = _variant(None)
    assert not variant.mods and not variant.scalar_mods and variant.causal
    assert "Mods::none" in variant.name_expression("fwd")


def test_every_scalars_variant_is_shipped_beside_its_full_one():
    shipped = set(_kernels.shipped_variants())
    scalars = [v for v in shipped if v.scalar_mods]
    assert scalars and all(v.mods and not v.dropout and v.direction in ("fwd", "bwd") for v in scalars)
    for v in scalars:
        assert _kernels.dataclasses.replace(v, scalar_mods=False, bounded=False, softcap_alone=False, window_alone=False,
                                            warp_specialized=False, alibi=False, half_first=False, block_mask=False,
                                            causal=False) in shipped


def _at_128(dtype=np.float16, direction="bwd", causal=True, dropout=None, packed=False, **options):
    """The variant of a (2, 3, 100 x 120) call at HEAD_DIM 128 with these options."""
    mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, **options)
    return _kernels._variant(direction, dtype, 128, 128, causal, mods, dropout, packed=packed)


def test_a_softcap_alone_takes_the_softcap_backward_on_the_wgmma_path(monkeypatch):
    """A 16-bit wgmma backward whose only modifier is a softcap runs Mods::softcap, causal as the plain kernels
    take it; anything more (or its forward, float32, dropout, a packed batch, the mma.sync path) does not."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    shipped = set(_kernels.shipped_variants())
    slopes = np.ones((3,), dtype=np.float32)

    for dtype in (np.float16, ml_dtypes.bfloat16):
        for causal in (False, True):
            chosen = _at_128(dtype, causal=causal, softcap=5.0)
            assert chosen.softcap_alone and chosen.scalar_mods and chosen.wgmma and chosen.causal == causal
            assert f"{'true' if causal else 'false'}, Mods::softcap, true" in chosen.name_expression("dkdv")
            assert chosen in shipped
    for options in (dict(softcap=5.0, window=(10, 0)), dict(softcap=5.0, window=(-1, 0)),
                    dict(softcap=5.0, alibi_slopes=slopes), dict(softcap=5.0, block_mask=np.ones((1, 1), bool)),
                    dict(softcap=5.0, bias=np.zeros((100, 120), np.float16)), dict(window=(10, 0))):
        chosen = _at_128(**options)
        assert not chosen.softcap_alone and not chosen.causal, options
    assert not _at_128(direction="fwd", softcap=5.0).softcap_alone
    assert not _at_128(np.float32, softcap=5.0).softcap_alone
    assert not _at_128(softcap=5.0, dropout=_dropout.Dropout(0.1, 1)).softcap_alone
    assert not _at_128(softcap=5.0, packed=True).softcap_alone
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: False)
    assert not _at_128(softcap=5.0).softcap_alone


def test_a_window_alone_takes_the_window_instantiation_on_the_wgmma_path(monkeypatch):
    """A 16-bit wgmma forward or backward whose only modifier is a window (causal travelling in it) runs
    Mods::window; a softcap, ALiBi, a block mask, an array, dropout, float32, a packed batch or the mma.sync
    path take the other instantiations."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    shipped = set(_kernels.shipped_variants())
    slopes = np.ones((3,), dtype=np.float32)

    for dtype in (np.float16, ml_dtypes.bfloat16):
        for direction in ("fwd", "bwd"):
            for causal, window in ((True, (10, 0)), (False, (5, 17)), (False, (-1, 3)), (True, (0, -1))):
                chosen = _at_128(dtype, direction, causal, window=window)
                assert chosen.window_alone and chosen.scalar_mods and chosen.wgmma and not chosen.causal, window
                assert not chosen.softcap_alone and not chosen.bounded
                name = chosen.name_expression(direction if direction == "fwd" else "dkdv")
                assert "false, Mods::window" in name and chosen in shipped, name
    for options in (dict(window=(10, 0), softcap=5.0), dict(window=(10, 0), alibi_slopes=slopes),
                    dict(window=(10, 0), block_mask=np.ones((1, 1), bool)),
                    dict(window=(10, 0), bias=np.zeros((100, 120), np.float16)),
                    dict(window=(10, 0), mask=np.ones((100, 120), bool)), dict(softcap=5.0)):
        for direction in ("fwd", "bwd"):
            assert not _at_128(direction=direction, **options).window_alone, (direction, options)
    assert not _at_128(np.float32, window=(10, 0)).window_alone
    assert not _at_128(window=(10, 0), dropout=_dropout.Dropout(0.1, 1)).window_alone
    assert not _at_128(window=(10, 0), packed=True).window_alone
    mods = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, window=(10, 0))
    for head_dim in sorted({v.head_dim for v in shipped if v.wgmma and v.itemsize == 2}):  # every wgmma head dim
        for direction in ("fwd", "bwd"):
            chosen = _kernels._variant(direction, np.float16, head_dim, head_dim, True, mods)
            assert chosen.window_alone and chosen.scalar_mods and chosen in shipped, (head_dim, direction)
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: False)
    assert not _at_128(window=(10, 0)).window_alone


def test_the_window_alone_forward_takes_its_own_tiles_and_ctas_per_sm(monkeypatch):
    """At the head dims of _WGMMA_WINDOW_FWD the window-alone forward launches and names that table's tiles,
    CTAs per SM included (its launch bounds); every other forward keeps one CTA's bound, and the scalars'
    forward keeps its tiles."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    mods = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, window=(10, 0))
    for head_dim, entry in _config._WGMMA_WINDOW_FWD.items():
        # (where the warp-specialized forward serves, this one remains for inputs TMA cannot read)
        chosen = dataclasses.replace(_kernels._variant("fwd", np.float16, head_dim, head_dim, True, mods),
                                     warp_specialized=False)
        assert chosen.window_alone and chosen.tiles("fwd") == _config.Tiles(*entry)
        assert chosen.name_expression("fwd").endswith(f"Mods::window, false, false, {entry[4]}>")
        scalars = dataclasses.replace(chosen, window_alone=False)
        assert scalars.tiles("fwd").ctas_per_sm == 1 and scalars.tiles("fwd") != chosen.tiles("fwd")
    for variant in _kernels.shipped_variants():
        own = variant.window_alone and variant.head_dim in _config._WGMMA_WINDOW_FWD
        if variant.direction == "fwd" and variant.wgmma and not own and not variant.warp_specialized:
            assert variant.name_expression("fwd").endswith(", 1>"), variant


def test_the_window_alone_backward_takes_its_own_tiles(monkeypatch):
    """At the head dims of _WGMMA_WINDOW_BWD both window-alone backward passes launch and name that table's
    tiles, and the scalars' backward keeps its own."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    mods = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, window=(10, 0))
    assert _config._WGMMA_WINDOW_BWD
    for head_dim, entries in _config._WGMMA_WINDOW_BWD.items():
        chosen = _kernels._variant("bwd", np.float16, head_dim, head_dim, True, mods)
        scalars = dataclasses.replace(chosen, window_alone=False)
        assert chosen.window_alone and chosen.wgmma
        for kernel, entry in zip(("dkdv", "dq"), entries):
            tiles = _config.Tiles(*entry)
            assert chosen.tiles(kernel) == tiles and scalars.tiles(kernel) != tiles, (head_dim, kernel)
            expected = f"<half_t, {head_dim}, {tiles.num_warps}, {tiles.block}, {tiles.d_chunk}, false, Mods::window,"
            assert expected in chosen.name_expression(kernel), chosen.name_expression(kernel)


def test_the_warp_specialized_forward_serves_plain_causal_and_scalar_modifiers_where_listed(monkeypatch):
    """At the head dims of _config.WS_FWD the 16-bit plain, causal, window-alone and scalar-modifier (window,
    softcap, ALiBi) forwards of dense batches on Hopper are the warp-specialized kernel: its name (the
    scalars as Mods::dense_scalars, bounded for a bfloat16 softcap without ALiBi, its ALiBi form wherever there
    are slopes), three warpgroups owning
    WS_ROWS rows, its persistent grid (one CTA per SM, at most one per tile), its shared memory within an
    sm_90 CTA's 227 KiB. Backwards, dropout, float32, the modifiers' arrays, packed batches, other head dims
    and the mma.sync path are not. Both forms of each are shipped."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    monkeypatch.setattr(_kernels, "_sm_count", lambda: 132)
    shipped = set(_kernels.shipped_variants())
    window = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, window=(10, 0))
    softcap = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, softcap=20.0)
    scalars = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, softcap=20.0, window=(50, 3),
                                 alibi_slopes=np.ones(3, np.float32))
    bias = _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, bias=np.zeros((100, 120), np.float16))
    dropout = _dropout.Dropout(0.1, 1)
    assert _config.WS_FWD and set(_config.WS_WINDOW_FWD) == set(_config.WS_FWD)
    for dtype, ctype in ((np.float16, "half_t"), (ml_dtypes.bfloat16, "bfloat16_t")):
        for head_dim in _config.HEAD_DIMS:
            if not _config.has_wgmma(2, head_dim):
                continue
            listed = head_dim in _config.WS_FWD
            # (causal as the kernel takes it, its Mods, the options, the variant chosen)
            forwards = [(causal, "Mods::none", None, _kernels._variant("fwd", dtype, head_dim, head_dim, causal))
                        for causal in (False, True)]
            forwards += [(False, mods, options, _kernels._variant("fwd", dtype, head_dim, head_dim, True, options))
                         for mods, options in (("Mods::window", window), ("Mods::dense_scalars", softcap),
                                               ("Mods::dense_scalars", scalars))]
            assert all(chosen.warp_specialized == listed for *_, chosen in forwards), head_dim
            assert not _kernels._variant("bwd", dtype, head_dim, head_dim, True, window).warp_specialized
            assert not _kernels._variant("bwd", dtype, head_dim, head_dim, True).warp_specialized
            assert not _kernels._variant("bwd", dtype, head_dim, head_dim, True, softcap).warp_specialized
            assert not _kernels._variant("fwd", dtype, head_dim, head_dim, True, bias).warp_specialized
            assert not _kernels._variant("fwd", dtype, head_dim, head_dim, True, softcap, packed=True).warp_specialized
            assert not _kernels._variant("fwd", dtype, head_dim, head_dim, True, dropout=dropout).warp_specialized
            if not listed:
                continue
            for causal, mods, options, chosen in forwards:
                block, stages = (_config.WS_WINDOW_FWD if mods == "Mods::window" else _config.WS_FWD)[head_dim]
                assert chosen.name_expression("fwd") == (
                    f"attention_fwd_ws_kernel<{ctype}, {head_dim}, {block}, {stages}, {str(causal).lower()}, {mods}, "
                    f"{str(chosen.bounded).lower()}, {str(chosen.alibi).lower()}, {str(chosen.half_first).lower()}, "
                    "false>")
                assert chosen.threads("fwd") == 3 * 128 and chosen.tiles("fwd").rows == _config.WS_ROWS
                for rows, batch, ctas in ((1000, 3, 24), (8192, 32, 132), (1, 1, 1)):
                    grid, block_shape, smem = _kernels._launch_shape(chosen, "fwd", rows, batch)
                    assert (grid, block_shape, smem) == ((ctas, 1, 1), (384,), chosen.smem("fwd")), (rows, batch)
                assert chosen.smem("fwd") + 1024 <= 227 * 1024
                assert "attention_fwd_ws.cu" in chosen.code() and "attention_fwd_ws_kernel" in chosen.code()
                assert chosen in shipped
                assert dataclasses.replace(chosen, warp_specialized=False, alibi=False, half_first=False) in shipped
                assert not chosen.block_mask
                assert chosen.bounded == (options is softcap and ctype == "bfloat16_t")
                assert chosen.alibi == (options is scalars)
                assert chosen.half_first == chosen.alibi  # scalars' window (50, 3) with causal: right edge 0
                # ALiBi's half-width first block where the window has a right edge (causal or not), only there
                for window_, causal_, half in (((-1, -1), False, False), ((-1, -1), True, True), ((50, 3), False, True),
                                               ((50, -1), False, False), ((50, -1), True, True)):
                    alibi_mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, window=window_,
                                                    alibi_slopes=np.ones(3, np.float32))
                    alibi_variant = _kernels._variant("fwd", dtype, head_dim, head_dim, causal_, alibi_mods)
                    assert alibi_variant.alibi and alibi_variant.half_first == half, (window_, causal_)
                    assert alibi_variant in shipped
    assert not _kernels._variant("fwd", np.float32, 128, 128, True).warp_specialized
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: False)
    assert not _kernels._variant("fwd", np.float16, 128, 128, True, window).warp_specialized
    assert not _kernels._variant("fwd", np.float16, 128, 128, True).warp_specialized
    ws = [v for v in shipped if v.warp_specialized]
    assert ws and all(v.direction == "fwd" and v.itemsize == 2 and v.wgmma and not v.dropout
                      and v.head_dim in _config.WS_FWD and (v.scalar_mods or not v.mods) for v in ws)
    assert {(v.ctype, v.head_dim) for v in ws if v.alibi} == {(c, d) for c in ("half_t", "bfloat16_t") for d in _config.WS_FWD}
    assert all(v.scalar_mods and not v.bounded and not v.window_alone for v in ws if v.alibi)
    assert {v for v in ws if v.half_first} == {dataclasses.replace(v, half_first=True) for v in ws if v.alibi}
    assert not any(v.half_first for v in shipped if not v.alibi)
    assert not any(v.alibi for v in shipped if not v.warp_specialized)
    with pytest.raises(ValueError, match="16-bit plain, causal and scalar-modifier forwards"):
        _config.tiles(2, 128, "fwd", mods=True, wgmma=True, warp_specialized=True)


class _FakeArray:
    def __init__(self, shape, strides, ptr=1 << 20, itemsize=2):
        self.shape, self.strides = shape, strides
        self.dtype = np.dtype(np.float16) if itemsize == 2 else np.dtype(np.float32)
        self.data = type("Pointer", (), {"ptr": ptr})()


def test_tensor_maps_describe_aligned_strided_inputs_but_not_broadcast_ones():
    """_tma.describable: a 16-byte aligned start and strides, and no batch dim of several entries at stride 0."""
    from cupyflash import _tma

    dense = _FakeArray((2, 3, 100, 128), (2 * 3 * 100 * 256, 3 * 100 * 256, 256, 2))
    assert _tma.describable(dense, [1, 2, 3], [0, 300 * 128, 100 * 128])
    sliced = _FakeArray((2, 3, 100, 128), (2 * 3 * 100 * 272, 3 * 100 * 272, 272, 2))  # rows of 136 elements
    assert _tma.describable(sliced, [1, 2, 3], [0, 300 * 136, 100 * 136])
    assert not _tma.describable(dense, [1, 2, 3], [0, 300 * 128, 0])  # heads broadcast
    assert _tma.describable(dense, [1, 1, 3], [0, 0, 100 * 128])  # a dim of one entry: any stride
    assert not _tma.describable(_FakeArray((2, 100, 128), (100 * 256, 256, 2), ptr=(1 << 20) + 8), [1, 1, 2],
                                [0, 0, 100 * 128])
    assert not _tma.describable(_FakeArray((2, 100, 128), (100 * 264, 264, 2)), [1, 1, 2], [0, 0, 100 * 132])


def test_tensor_maps_are_encoded_once_per_set_of_addresses(monkeypatch):
    """TensorMaps.encode: the maps of q, k, v in order, each at a 64-byte aligned address of the argument's
    bytes; a call with the previous call's addresses returns the previous argument without encoding, any
    other encodes every map again. (A stand-in for the driver's encoder writes each map's address and its
    rows of box.)"""
    import ctypes

    from cupyflash import _tma

    calls = []

    def encode(at, code, rank, address, dims, strides, box, element_strides, *flags):
        calls.append((at % 64, address))
        words = (ctypes.c_uint64 * 16)(address, box[1], *([0] * 14))
        ctypes.memmove(at, words, _tma.MAP_BYTES)
        return 0

    monkeypatch.setattr(_tma, "_encoder", lambda: encode)
    dense = _FakeArray((2, 3, 100, 128), (2 * 3 * 100 * 256, 3 * 100 * 256, 256, 2))
    arrays = {"q": dense, "k": dense, "v": dense}
    strides = {name: [0, 300 * 128, 100 * 128] for name in arrays}
    maps = _tma.TensorMaps(arrays, [1, 2, 3], strides, {"q": 64, "k": 32, "v": 32})
    first = maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 3 << 20})
    assert [offset for offset, _ in calls] == [0, 0, 0] and len(calls) == 3
    assert first.dtype.itemsize == 3 * _tma.MAP_BYTES and first.shape == (1,)
    words = first.view(np.uint64).reshape(3, 16)
    assert words[:, 0].tolist() == [1 << 20, 2 << 20, 3 << 20] and words[:, 1].tolist() == [64, 32, 32]
    assert maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 3 << 20}) is first and len(calls) == 3
    second = maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 4 << 20})
    assert len(calls) == 6 and second is not first
    assert second.view(np.uint64).reshape(3, 16)[:, 0].tolist() == [1 << 20, 2 << 20, 4 << 20]
    assert words[2, 0] == 3 << 20, "an argument once made is never written again"


def test_ctas_per_sm_fit_the_shared_memory_of_an_sm():
    """Only the wgmma forward takes ctas_per_sm (its launch bounds), and a kernel compiled for n CTAs per SM
    must also leave room for them in shared memory: n times its dynamic shared memory, its static (under
    1 KiB: the block-mask bitmap and a few words) and the 1 KiB the hardware reserves per CTA, within
    Hopper's 228 KiB per SM (the registers are ptxas' part of the bound: tests/test_compile.py checks that
    nothing spills)."""
    checked = 0
    for variant in _kernels.shipped_variants():
        for kernel in variant.kernels:
            if kernel == "preprocess" or variant.tiles(kernel).ctas_per_sm == 1:
                continue
            ctas = variant.tiles(kernel).ctas_per_sm
            assert kernel == "fwd" and variant.wgmma, (variant, kernel)
            assert ctas * (variant.smem(kernel) + 2048) <= 228 * 1024, (variant, kernel)
            checked += 1
    assert checked == 2 * len(_config._WGMMA_WINDOW_FWD)  # the window-alone forwards listed, fp16 and bf16


def test_a_block_mask_forward_walks_it_on_the_warp_specialized_kernel(monkeypatch):
    """A 16-bit forward at a head dim of _config.WS_FWD whose only array is a block mask (with or without the
    scalar modifiers) runs the warp-specialized kernel's BLOCK_MASK form (Mods::dense_scalars; bounded, ALiBi and
    half-first forms as without the mask); with a bias or a mask, dropout, a packed batch, another head dim,
    float32, the mma.sync path or ws=False (attention_forward: TMA cannot read the inputs, or more key tiles
    than the walk holds) it takes Mods::all. Its backward is the scalars' passes either way."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    shipped = set(_kernels.shipped_variants())
    on = np.ones((1, 1), bool)
    slopes = np.ones(3, np.float32)
    for dtype, ctype in ((np.float16, "half_t"), (ml_dtypes.bfloat16, "bfloat16_t")):
        for causal, options, bounded, alibi, half in (
                (False, {}, False, False, False), (True, {}, False, False, False),
                (True, dict(window=(200, 0)), False, False, False),
                (False, dict(softcap=20.0), ctype == "bfloat16_t", False, False),
                (True, dict(alibi_slopes=slopes), False, True, True),
                (False, dict(alibi_slopes=slopes), False, True, False)):
            chosen = _at_128(dtype, "fwd", causal, block_mask=on, **options)
            assert chosen.block_mask and chosen.warp_specialized and chosen.scalar_mods and not chosen.window_alone
            assert (chosen.bounded, chosen.alibi, chosen.half_first) == (bounded, alibi, half), options
            assert chosen.name_expression("fwd") == (
                f"attention_fwd_ws_kernel<{ctype}, 128, 128, 2, false, Mods::dense_scalars, {str(bounded).lower()}, "
                f"{str(alibi).lower()}, {str(half).lower()}, true>"), options
            assert chosen in shipped
            assert dataclasses.replace(chosen, block_mask=False) in shipped  # the same form without the walk
            backward = _at_128(dtype, "bwd", causal, block_mask=on, **options)
            assert backward.scalar_mods and not backward.block_mask and "Mods::scalars" in backward.name_expression("dq")
    full = [_at_128(block_mask=on, direction="fwd", bias=np.zeros((100, 120), np.float16)),
            _at_128(block_mask=on, direction="fwd", mask=np.ones((100, 120), bool)),
            _at_128(block_mask=on, direction="fwd", dropout=_dropout.Dropout(0.1, 1)),
            _at_128(block_mask=on, direction="fwd", packed=True),
            _at_128(np.float32, "fwd", block_mask=on),
            _kernels._variant("fwd", np.float16, 64, 64, True, _mods(block_mask=on)),
            _kernels._variant("fwd", np.float16, 128, 128, True, _mods(block_mask=on), ws=False)]
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: False)
    full.append(_at_128(block_mask=on, direction="fwd"))
    for chosen in full:
        assert not chosen.block_mask and not chosen.warp_specialized and "Mods::all" in chosen.name_expression("fwd"), chosen
    assert {v for v in shipped if v.block_mask} == {dataclasses.replace(v, block_mask=True) for v in shipped
                                                    if v.warp_specialized and v.scalar_mods and not v.window_alone}


def test_the_warp_specialized_block_mask_walk_holds_2048_key_tiles():
    """The kernel's walk keeps a tile's key blocks as bits and entries in shared memory (TILE_BITMAP_WORDS
    words of 32); attention_forward sends a longer key axis to Mods::all."""
    words = int(re.search(r"constexpr int TILE_BITMAP_WORDS = (\d+);", _kernels.source("score_mods.cuh")).group(1))
    assert _config.WS_BLOCK_MASK_TILES == 32 * words == 2048
    assert _kernels._ws_block_mask_fits(2048 * 128) and not _kernels._ws_block_mask_fits(2048 * 128 + 1)


def test_softcapped_bfloat16_without_alibi_takes_the_bounded_forward(monkeypatch):
    """On the wgmma path the bfloat16 forward with a softcap of at most BOUNDED_SOFTCAP_MAX and no ALiBi (window
    or not) takes 1 as every row's max, in the warp-specialized forward too (and in the one it falls back
    to); anything else keeps the row max."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    bf16, slopes = np.dtype(ml_dtypes.bfloat16), np.ones((3,), dtype=np.float32)
    limit = _kernels.BOUNDED_SOFTCAP_MAX
    assert 42.9 < limit < 43.0  # 62 ln 2: exp2(-2 * 62) stays a normal float
    shipped = set(_kernels.shipped_variants())

    def variant(dtype=bf16, direction="fwd", dropout=None, head_dim=128, **options):
        mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, **options)
        return _kernels._variant(direction, dtype, head_dim, head_dim, True, mods, dropout)

    for options in (dict(softcap=2.0), dict(softcap=limit), dict(softcap=30.0, window=(10, 0))):
        for head_dim in (64, 128):
            chosen = variant(head_dim=head_dim, **options)
            assert chosen.bounded and chosen.scalar_mods and chosen.wgmma, options
            assert chosen.warp_specialized == (head_dim in _config.WS_FWD)
            expected = "Mods::dense_scalars, true, false, false, false>" if chosen.warp_specialized else "Mods::scalars, false, true, 1>"
            assert chosen.name_expression("fwd").endswith(expected), chosen.name_expression("fwd")
            assert chosen in shipped and dataclasses.replace(chosen, warp_specialized=False) in shipped
    assert not variant(softcap=float(np.nextafter(limit, np.inf))).bounded
    assert not variant(softcap=50.0).bounded
    assert not variant(softcap=30.0, alibi_slopes=slopes).bounded
    assert not variant(window=(10, 0)).bounded
    assert not variant(dtype=np.float16, softcap=30.0).bounded
    assert not variant(direction="bwd", softcap=30.0).bounded
    assert not variant(softcap=30.0, dropout=_dropout.Dropout(0.1, 1)).bounded
    assert not variant(softcap=30.0, bias=np.zeros((100, 120), bf16)).bounded
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: False)
    assert not variant(softcap=30.0).bounded  # the mma.sync forward has no bounded instantiation


def test_scalars_tiles_are_the_plain_ones_only_where_listed():
    for path, itemsize, head_dim, kernel in _config._SCALAR_MODS_PLAIN:
        options = dict(wgmma=path == "wgmma", large_smem=path == "large")
        mods = _config.tiles(itemsize, head_dim, kernel, mods=True, **options)
        scalars = _config.tiles(itemsize, head_dim, kernel, mods=True, scalar_mods=True, **options)
        plain = _config.tiles(itemsize, head_dim, kernel, **options)
        assert scalars != mods
        assert scalars == plain or plain.split  # a split plain tile gives way to its unsplit form
    assert _config.tiles(2, 192, "fwd", mods=True, wgmma=True, scalar_mods=True) == \
        _config.tiles(2, 192, "fwd", mods=True, wgmma=True)  # not listed: it spills with the plain tile
