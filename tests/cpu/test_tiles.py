"""The one tile table (cupyflash/_cuda/tiles.py): its text, its cells, and that every shipped variant's kernels
have theirs, whose shapes fit the kernels and whose switches reach the kernels' names (no GPU needed)."""

import pytest

from cupyflash._cuda import tile_policy, tiles
from cupyflash._cuda.variants import CTYPES, Variant

SHIPPED = tile_policy.shipped_variants()
SHIPPED_SET = set(SHIPPED)


def _bool(x):
    return "true" if x else "false"


def test_lookup_reads_the_table():
    """Spot checks of the table's text against lookup: ``=`` is the plain cell, flags after ``/``."""
    plain = tiles.lookup("mma", 2, 160, "dkdv", "plain")
    assert (plain.num_warps, plain.block, plain.d_chunk, plain.paired, plain.lse_by_copy) == (8, 32, 160, True, True)
    assert plain.threads == 256 and plain.rows == 64  # paired: 8 rows per pair of warps
    assert tiles.lookup("mma", 2, 160, "fwd", "scalars") == tiles.lookup("mma", 2, 160, "fwd", "plain")
    dq = tiles.lookup("wgmma", 2, 128, "dq", "plain")
    assert (dq.pipelined, dq.across_turn, dq.lse_by_copy, dq.paired) == (True, True, False, False)
    window = tiles.lookup("wgmma", 2, 16, "fwd", "window")
    assert (window.num_warps, window.block, window.ctas_per_sm) == (4, 64, 4)
    ws = tiles.lookup("ws", 2, 128, "fwd", "plain")
    assert (ws.num_warps, ws.block, ws.stages, ws.pack_after_wait, ws.store_warps, ws.rows) == (
        12,
        128,
        2,
        True,
        False,
        128,
    )
    assert tiles.lookup("ws", 2, 128, "fwd", "window").store_warps
    assert tiles.lookup("ws", 2, 64, "fwd", "scalars").store_warps  # its plain cell's copier spilled there
    assert tiles.lookup("mma", 4, 64, "probs", "plain") == tiles.lookup("mma", 4, 64, "fwd", "all")
    with pytest.raises(ValueError, match="no tiles for fwd on the ws path"):
        tiles.lookup("ws", 2, 96, "fwd", "plain")
    with pytest.raises(ValueError, match="no tiles"):
        tiles.lookup("mma", 8, 64, "fwd", "scalars")  # float64 has no scalars form
    assert tiles.has("mma", 8, 64) and not tiles.has("mma", 8, 64, "scalars")


def test_head_dims_and_padding():
    assert tiles.HEAD_DIMS == (16, 32, 64, 96, 128, 160, 192, 256)
    assert [tiles.padded_head_dim(d) for d in (1, 16, 17, 40, 64, 65, 100, 129, 192, 193, 256)] == [
        16,
        16,
        32,
        64,
        64,
        96,
        128,
        160,
        192,
        256,
        256,
    ]
    with pytest.raises(ValueError, match="at most 256"):
        tiles.padded_head_dim(257)
    assert set(tiles.WS_HEAD_DIMS) <= set(tiles.HEAD_DIMS)
    # the preprocess's lanes per row: one per 16-byte chunk, a power of two, at most a warp
    for itemsize in (2, 4, 8):
        for head_dim in tiles.HEAD_DIMS:
            lanes = tiles.preprocess_lanes(itemsize, head_dim)
            chunks = head_dim * itemsize // 16
            assert lanes & (lanes - 1) == 0 and lanes <= 32 and (lanes >= chunks or lanes == 32)


def test_every_shipped_variant_has_its_cells():
    for v in SHIPPED:
        for kernel in v.kernels:
            if kernel == "preprocess":
                continue
            assert v.tiles(kernel) is not None  # lookup raises where the table has no cell
            assert (v.smem(kernel) > 0) == (kernel != "dq_convert") and v.threads(kernel) >= 32


def test_every_cell_of_the_table_is_used():
    """No dead cell: each is the tiles of some shipped variant's kernel (attention_probs reads the forward's
    ``all`` cell), and every (path, bytes, HEAD_DIM) row has all three kernels (ws: the forward, and maybe the
    fused backward)."""
    used = set()
    for v in SHIPPED:
        for kernel in v.kernels:
            if kernel in ("preprocess", "dq_convert"):  # (dq_convert reads the fused backward's cell)
                continue
            cell_kernel, form = ("fwd", "all") if kernel == "probs" else (kernel, v.form)
            used.add((v.path, v.itemsize, v.head_dim, cell_kernel, form))
    unused = set(tiles.CELLS) - used
    assert not unused, f"cells no shipped variant uses: {sorted(unused)}"
    rows = {key[:3] for key in tiles.CELLS}
    for path, itemsize, head_dim in rows:
        kernels = ("fwd",) if path == "ws" else ("fwd", "dkdv", "dq")
        for kernel in kernels:
            assert (path, itemsize, head_dim, kernel, "plain") in tiles.CELLS, (path, itemsize, head_dim, kernel)


def test_the_tables_text_is_well_formed():
    """Every row has a cell per form; a form is either built for all three kernels of a row or for none (ws: the
    forward in its forms, and the fused backward in the plain one)."""
    lines = [line for line in tiles.TABLE.splitlines() if line.strip() and not line.startswith("#")]
    assert lines and all(len(line.split()) == 4 + len(tiles.FORMS) for line in lines)
    by_row = {}
    for path, itemsize, head_dim, kernel, form in tiles.CELLS:
        by_row.setdefault((path, itemsize, head_dim, form), set()).add(kernel)
    for (path, itemsize, head_dim, form), kernels in by_row.items():
        if path == "ws":
            fused = form == "plain" and head_dim in tiles.WS_BWD_HEAD_DIMS and itemsize == 2
            assert kernels == ({"fwd", "bwd"} if fused else {"fwd"}), (path, head_dim, form, kernels)
        else:
            assert kernels == {"fwd", "dkdv", "dq"}, (path, kernels)


def test_the_flags_are_where_they_must_be():
    """PIPELINED (p) and ACROSS_TURN (a, only with p) on the wgmma backward's 16-bit passes without dropout
    or the modifiers' arrays; LSE_BY_COPY (c) on dK/dV passes; paired warps (d) on plain backward passes; CTAs per
    SM (x) on the wgmma forward; the ring (r), PACK_AFTER_WAIT (w) and STORE_WARPS (o) on the
    warp-specialized forward, which always has a ring and a copying warpgroup; the P V chunks (v) and S_FIRST (s)
    on its FP8 form alone; the ring (r) on the fused backward, in its plain form, paired (d) at HEAD_DIM 256
    alone."""
    for (path, itemsize, head_dim, kernel, form), t in tiles.CELLS.items():
        where = (path, itemsize, head_dim, kernel, form)
        if t.pipelined:
            assert path == "wgmma" and itemsize == 2 and kernel in ("dkdv", "dq"), where
            assert form in ("plain", "scalars", "window"), where
        assert not t.across_turn or t.pipelined, where
        assert not t.lse_by_copy or kernel == "dkdv", where
        assert not t.paired or (kernel in ("dkdv", "dq", "bwd") and form == "plain"), where
        assert t.ctas_per_sm == 1 or (path == "wgmma" and kernel == "fwd"), where
        if path == "ws" and kernel == "bwd":
            assert form == "plain" and t.stages >= 2 and t.copy_warps == tiles.WS_COPY_WARPS, where
            assert not (t.pack_after_wait or t.store_warps), where
            # two consumers of 64 keys each, or paired on the same 64 (HEAD_DIM 192, 256: dK and dV would not fit one)
            assert t.rows == (64 if t.paired else 128) and t.paired == (head_dim > 128), where
        elif path == "ws":
            assert kernel == "fwd" and t.stages > 0 and t.copy_warps == tiles.WS_COPY_WARPS, where
        else:
            assert not (t.stages or t.pack_after_wait or t.store_warps or t.copy_warps), where
        if itemsize != 1:  # the FP8 forward's alone: P V in chunks of its own accumulators, S first
            assert not (t.pv_cols or t.scores_first), where
        elif t.pv_cols:
            assert head_dim % t.pv_cols == 0 and t.pv_cols % 16 == 0 and not t.pack_after_wait, where
        assert not t.scores_first or t.pv_cols, where


def test_the_tiles_fit_the_kernels():
    """Whole warpgroups on Hopper's paths; the whole head dim per CTA in their forwards; column chunks that
    divide HEAD_DIM; a CTA's rows and its streamed block that divide a block-mask tile (a tile never straddles
    two); the FP8 forward's key blocks (1-byte rows, no block mask) divide quantize_fp8's row blocks, as a key
    block takes one k and one v descale; shared memory within what the variant's targets give a CTA."""
    from cupyflash._fp8.tensor import BLOCK_ROWS as FP8_BLOCK_ROWS
    from cupyflash._modifiers import BLOCK_MASK_TILE

    for (path, itemsize, head_dim, kernel, form), t in tiles.CELLS.items():
        where = (path, itemsize, head_dim, kernel, form)
        if path in ("wgmma", "pieces", "ws"):
            assert (t.num_warps - t.copy_warps) % 4 == 0, where
            if kernel == "fwd":
                assert t.d_chunk == head_dim, where
        assert head_dim % t.d_chunk == 0, where
        assert (FP8_BLOCK_ROWS if itemsize == 1 else BLOCK_MASK_TILE) % t.block == 0, where
        # a CTA's rows are whole block-mask tiles, except the warp-specialized forward's three-warpgroup tiles of
        # 192 rows, which its forms with a block mask never take
        assert BLOCK_MASK_TILE % t.rows == 0 or (path, kernel, t.rows, form) in (("ws", "fwd", 192, "plain"),), where
    for v in SHIPPED:
        limit = tiles.SM80_SMEM_BYTES if "sm_80" in v.compile_targets() else 227 * 1024
        for kernel in v.kernels:
            assert v.smem(kernel) <= limit, (v, kernel, v.smem(kernel))


def test_name_expressions_carry_the_cells_switches():
    """Each backward pass's name carries its cell's PAIRED, PIPELINED and ACROSS_TURN (and the dK/dV pass
    LSE_BY_COPY), the warp-specialized forward's its ring, PACK_AFTER_WAIT, STORE_WARPS and the FP8 form's P V
    chunks and S_FIRST, the fused backward's
    (and its dq conversion's) its query block, its ring and PAIRED; every kernel that stores results ends with
    their type (unrounded: float, where the warp-specialized forward's storing warps stay off)."""
    for v in SHIPPED:
        results = CTYPES[v.out_dtype or v.dtype]
        assert (results == "float") == v.wide or v.dtype == "float32", v
        for kernel in v.kernels:
            if kernel in ("preprocess", "probs"):
                continue
            t, name = v.tiles(kernel), v.name_expression(kernel)
            if kernel in ("dkdv", "dq"):
                tail = f"{_bool(t.paired)}, {_bool(t.pipelined)}, {_bool(t.across_turn)}"
                tail += f", {_bool(t.lse_by_copy)}, {results}>" if kernel == "dkdv" else f", {results}>"
                assert name.endswith(tail), (v, name)
                assert name.startswith(f"attention_bwd_{kernel}_kernel<")
            elif kernel == "bwd":
                chains = tiles.ws_bwd_dq_chains(t, v.deterministic)
                assert name == (
                    f"attention_bwd_ws_kernel<{CTYPES[v.dtype]}, {v.head_dim}, {t.block}, {t.stages}, "
                    f"{_bool(v.causal)}, {_bool(v.deterministic)}, {chains}, {_bool(t.paired)}, {results}>"
                ), (v, name)
            elif kernel == "dq_convert":
                chains = tiles.ws_bwd_dq_chains(t, v.deterministic)
                assert name == (
                    f"attention_bwd_dq_convert_kernel<{CTYPES[v.dtype]}, {v.head_dim}, {t.block}, "
                    f"{_bool(v.causal)}, {chains}, {_bool(t.paired)}, {results}>"
                )
            elif v.path == "ws":
                warpgroups = t.rows // tiles.WS_WARPGROUP_ROWS
                assert name.endswith(
                    f"{_bool(t.pack_after_wait)}, {_bool(t.store_warps and not v.wide)}, {results}, {warpgroups}, "
                    f"{t.pv_cols}, {_bool(t.scores_first)}>"
                ), (v, name)
                assert f", {t.block}, {t.stages}, " in name
            else:  # the other forwards
                assert name.endswith(f", {results}>"), (v, name)
    dkdv = Variant("bwd", "float16", 128, "wgmma").name_expression("dkdv")
    assert (
        dkdv == "attention_bwd_dkdv_kernel<half_t, 128, 4, 64, 128, false, Mods::none, true, false, false, true, "
        "true, true, half_t>"
    )
    wide = Variant("bwd", "bfloat16", 128, "wgmma", out_dtype="float32").name_expression("dq")
    assert wide == (
        "attention_bwd_dq_kernel<bfloat16_t, 128, 4, 64, 128, false, Mods::none, true, false, false, true, true, float>"
    )


def test_variants_for_each_arch():
    """sm_80 gets the mma.sync variants that fit its shared memory; sm_90 every variant."""
    sm80, sm90 = tile_policy.variants_for("sm_80"), tile_policy.variants_for("sm_90")
    assert set(sm90) == SHIPPED_SET
    assert sm80 and all(v.path == "mma" for v in sm80)
    assert {v for v in SHIPPED if v.path == "mma"} - set(sm80) == {
        v for v in SHIPPED if v.path == "mma" and "sm_80" not in v.compile_targets()
    }
