"""The one table of kernel tiles: for every (path, element bytes, HEAD_DIM, kernel) and every form of the
kernel (which score modifiers it is compiled for, with or without dropout), the tile shape and the
switches that choose between two versions of its code. Kernels take both as template parameters
(``variants.Variant``). Constants that are the same for every instantiation of a kernel (the
warp-specialized forward's L2 section size, its register split, the share of the bounded softcap's
exponentials on the FMA units) stay in the kernel, with their reason.

Paths: ``mma`` (mma.sync, every GPU from compute capability 8.0 on), ``large`` (float64 tiles that need
Hopper's 227 KiB of shared memory per CTA), ``wgmma`` (Hopper's warpgroup products, 16-bit), ``pieces``
(float32 on Hopper as float16 pieces, plain and causal) and ``ws`` (the warp-specialized 16-bit forward; its
1-byte rows are the FP8 forward's, on e4m3 inputs).
Forms (the table's columns): ``plain`` (no modifier; causal or not), ``dropout``, ``all`` (every score
modifier, the per-element arrays included; also packed batches and attention_probs), ``all+dropout``,
``scalars`` (window, softcap, ALiBi and the backward's block mask, no per-element array; also a softcap
alone's backward) and ``window`` (a window alone). Kernels: ``fwd`` (attention_probs takes its rows'
``all`` cell), ``dkdv`` and ``dq`` (the backward's passes; its preprocess needs no tiles) and ``bwd`` (the
warp-specialized fused backward, plain and causal; its dq conversion reads the same cell).

A cell is ``NUM_WARPS.BLOCK.D_CHUNK`` then, after ``/``, its flags:
  d   duo: two warps share 16 rows, one holding each gradient (dkdv, dq: Tiles.paired); the fused backward's
      two consumers share 64 keys, one holding dV, the other dK (PAIRED)
  xN  the launch bounds ask for N resident CTAs per SM (wgmma forward: short CTAs hide each other's setup)
  p   the backward's products stay in flight while the next tile's elementwise work runs (PIPELINED)
  a   ... across the loop's turn too (ACROSS_TURN)
  c   the dK/dV pass copies each query tile's lse and delta with cp.async (LSE_BY_COPY)
  rN  the warp-specialized forward's ring of N K/V slots, the fused backward's of N q/dout slots (STAGES)
  w   it rounds P to 16 bits after the previous P V's wait, so P V is one wgmma per k-step (PACK_AFTER_WAIT)
  o   warps of its copying warpgroup store out, one per computing warpgroup (STORE_WARPS)
  vN  the FP8 forward's P V in chunks of N columns, each added to O in float32 apart (PV_COLS; without it, whole)
  s   the FP8 forward runs a key block's S and softmax alone, then the previous block's P V (S_FIRST)
``=``: the plain cell; ``.``: not built. BLOCK is the streamed tile: keys (fwd, dq) or queries (dkdv, bwd).
D_CHUNK: the output (fwd) or gradient (dkdv, dq, bwd) columns per CTA; a CTA's rows are 16 per computing warp
(8 with d). Every cell compiles with no register spills for sm_80 and sm_90 (CI checks); cells other than
the plain ones exist because the plain tiles spilled there or ran slower. docs/design/tiles.md gives each
reason and measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from cupyflash._checks import MAX_HEAD_DIM

FORMS = ("plain", "dropout", "all", "all+dropout", "scalars", "window")
KERNELS = ("fwd", "dkdv", "dq", "bwd")

TABLE = """
# path  bytes D    kernel plain          dropout        all            all+dropout    scalars        window
mma    2  16   fwd   4.128.16       =              =              =              =              .
mma    2  16   dkdv  4.64.16/c      4.64.16        4.64.16        4.32.16        =              .
mma    2  16   dq    4.64.16        =              =              =              =              .
mma    2  32   fwd   4.128.32       =              =              =              =              .
mma    2  32   dkdv  4.64.32/c      4.64.32        4.64.32        4.32.32        =              .
mma    2  32   dq    4.64.32        =              =              =              =              .
mma    2  64   fwd   4.128.64       =              =              =              =              .
mma    2  64   dkdv  4.64.64/c      4.64.64        4.32.64        4.32.64        =              .
mma    2  64   dq    4.64.64        =              =              =              =              .
mma    2  96   fwd   4.64.96        =              =              =              =              .
mma    2  96   dkdv  4.32.96/c      4.32.96        4.32.96        4.16.96        =              .
mma    2  96   dq    4.32.96        =              =              =              =              .
mma    2  128  fwd   4.128.128      =              =              4.64.128       =              .
mma    2  128  dkdv  4.32.128/c     4.32.128       4.32.128       4.16.128       =              .
mma    2  128  dq    4.32.128       =              =              =              =              .
mma    2  160  fwd   8.64.160       =              =              =              =              .
mma    2  160  dkdv  8.32.160/dc    4.32.80        4.32.80        4.32.80        4.32.80/c      .
mma    2  160  dq    4.32.80        =              =              =              =              .
mma    2  192  fwd   8.64.192       =              =              =              =              .
mma    2  192  dkdv  8.32.192/dc    4.32.96        4.32.96        4.16.96        4.32.96/c      .
mma    2  192  dq    4.32.96        =              =              =              =              .
mma    2  256  fwd   4.64.256       =              4.32.256       4.32.256       =              .
mma    2  256  dkdv  8.32.256/dc    4.16.128       4.16.128       4.16.128       4.16.128/c     .
mma    2  256  dq    4.32.128       =              =              =              =              .
mma    4  16   fwd   4.64.16        =              =              =              =              .
mma    4  16   dkdv  4.32.16/c      4.32.16        4.32.16        4.32.16        =              .
mma    4  16   dq    4.32.16        =              =              =              =              .
mma    4  32   fwd   4.64.32        =              =              =              =              .
mma    4  32   dkdv  4.32.32/c      4.32.32        4.32.32        4.32.32        =              .
mma    4  32   dq    4.32.32        =              =              =              =              .
mma    4  64   fwd   4.64.64        =              =              =              =              .
mma    4  64   dkdv  8.32.64/dc     4.32.32        4.32.32        4.32.32        4.32.32/c      .
mma    4  64   dq    4.32.64        =              =              =              =              .
mma    4  96   fwd   4.32.96        =              =              =              =              .
mma    4  96   dkdv  4.16.48/c      4.16.48        4.16.48        4.16.48        =              .
mma    4  96   dq    4.16.96        =              =              =              =              .
mma    4  128  fwd   4.32.128       =              =              =              =              .
mma    4  128  dkdv  8.16.128/dc    4.16.64        4.16.64        4.16.64        4.16.64/c      .
mma    4  128  dq    4.16.128       =              =              =              =              .
mma    4  160  fwd   4.16.160       =              =              =              =              .
mma    4  160  dkdv  2.16.32/c      2.16.32        2.16.32        2.16.32        =              .
mma    4  160  dq    2.16.80        =              =              =              =              .
mma    4  192  fwd   4.16.192       =              4.16.96        4.16.96        4.16.96        .
mma    4  192  dkdv  2.16.48/c      2.16.48        2.16.48        2.16.48        =              .
mma    4  192  dq    2.16.96        =              =              =              =              .
mma    4  256  fwd   4.16.128       =              =              =              =              .
mma    4  256  dkdv  2.16.32/c      2.16.32        2.16.32        2.16.32        =              .
mma    4  256  dq    2.16.128       =              =              =              =              .
mma    8  16   fwd   4.64.16        =              =              =              .              .
mma    8  16   dkdv  4.32.16/c      4.32.16        4.32.16        4.32.16        .              .
mma    8  16   dq    4.32.16        =              =              =              .              .
mma    8  32   fwd   4.64.32        =              =              =              .              .
mma    8  32   dkdv  4.32.32/c      4.32.32        4.32.32        4.16.32        .              .
mma    8  32   dq    4.32.32        =              =              =              .              .
mma    8  64   fwd   8.64.64        =              8.32.64        8.32.64        .              .
mma    8  64   dkdv  4.16.64/c      4.16.32        4.16.64        4.16.64        .              .
mma    8  64   dq    4.32.64        =              =              =              .              .
mma    8  96   fwd   8.32.96        =              =              =              .              .
mma    8  96   dkdv  8.16.96/dc     4.16.48        4.16.48        4.16.48        .              .
mma    8  96   dq    4.16.96        =              =              =              .              .
mma    8  128  fwd   4.32.128       =              4.32.64        4.32.64        .              .
mma    8  128  dkdv  4.16.128/dc    2.16.32        2.16.32        2.16.32        .              .
mma    8  128  dq    2.16.128       =              =              =              .              .
mma    8  160  fwd   4.16.80        =              =              =              .              .
mma    8  160  dkdv  2.16.160/dc    1.16.32        1.16.32        1.16.32        .              .
mma    8  160  dq    1.16.80        =              =              =              .              .
mma    8  192  fwd   4.16.96        =              =              =              .              .
mma    8  192  dkdv  2.16.96/dc     1.16.48        1.16.48        1.16.48        .              .
mma    8  192  dq    1.16.96        =              =              =              .              .
mma    8  256  fwd   2.16.128       =              =              =              .              .
mma    8  256  dkdv  2.16.128/dc    1.16.32        1.16.32        1.16.32        .              .
mma    8  256  dq    1.16.128       =              =              =              .              .
large  8  128  fwd   8.32.128       =              8.32.64        8.32.64        .              .
large  8  128  dkdv  8.16.128/dc    4.16.32        4.16.32        4.16.32        .              .
large  8  128  dq    4.16.128       =              =              =              .              .
wgmma  2  16   fwd   4.128.16       =              4.64.16        4.64.16        =              4.64.16/x4
wgmma  2  16   dkdv  4.64.16/pc     4.64.16        4.64.16/c      4.32.16/c      =              =
wgmma  2  16   dq    4.64.16/pa     4.64.16        4.64.16        4.64.16        =              =
wgmma  2  32   fwd   4.128.32       =              4.64.32        4.64.32        =              4.64.32/x4
wgmma  2  32   dkdv  4.64.32/pc     4.64.32        4.64.32/c      4.32.32/c      =              =
wgmma  2  32   dq    4.64.32/pa     4.64.32        4.64.32        4.64.32        =              =
wgmma  2  64   fwd   4.128.64       =              4.64.64        4.64.64        =              4.64.64/x4
wgmma  2  64   dkdv  4.128.64/pc    4.64.64        4.32.64/c      4.32.64/c      =              4.64.64/pc
wgmma  2  64   dq    4.128.64/p     4.128.64       4.64.64        4.64.64        4.128.64       4.64.64/pa
wgmma  2  96   fwd   4.64.96        =              =              =              =              4.64.96/x3
wgmma  2  96   dkdv  4.64.96/c      4.32.96        4.32.96/c      4.16.96/c      4.32.96/c      4.32.96/c
wgmma  2  96   dq    4.64.96/pa     4.64.96        4.64.96        4.64.96        =              =
wgmma  2  128  fwd   4.64.128       =              =              =              =              4.32.128/x4
wgmma  2  128  dkdv  4.64.128/pac   4.64.128       4.32.128/c     4.16.128/c     =              =
wgmma  2  128  dq    4.64.128/pa    4.64.128       4.64.128       4.64.128       =              =
wgmma  2  160  fwd   8.64.160       =              =              =              =              =
wgmma  2  160  dkdv  4.16.160/pc    4.16.160       4.16.160/c     4.16.32/c      =              =
wgmma  2  160  dq    4.32.160/pa    4.32.160       4.32.160       4.32.160       =              =
wgmma  2  192  fwd   8.64.192       =              8.32.192       8.32.192       8.32.192       8.32.192
wgmma  2  192  dkdv  8.32.192/dc    4.32.64        4.32.64/c      4.32.64/c      4.32.64/pc     4.32.64/pc
wgmma  2  192  dq    4.32.192/pa    4.32.192       4.32.192       4.32.192       =              =
wgmma  2  256  fwd   8.64.256       =              8.32.256       8.32.256       =              =
wgmma  2  256  dkdv  8.64.256/dc    4.16.128       4.16.128/c     4.16.128/c     4.16.128/pc    4.16.128/pc
wgmma  2  256  dq    8.64.256/d     4.32.128       4.32.128       4.32.128       4.32.128/pa    4.32.128/pa
pieces 4  64   fwd   4.64.64        .              .              .              .              .
pieces 4  64   dkdv  4.64.64/c      .              .              .              .              .
pieces 4  64   dq    4.64.64        .              .              .              .              .
pieces 4  128  fwd   8.32.128       .              .              .              .              .
pieces 4  128  dkdv  8.32.64/c      .              .              .              .              .
pieces 4  128  dq    8.32.128       .              .              .              .              .
ws     2  64   fwd   16.128.64/r4w  .              .              .              12.128.64/r2wo 12.128.64/r2w
ws     2  128  fwd   12.128.128/r2w .              .              .              =              12.64.128/r4o
ws     2  192  fwd   12.64.192/r2w  .              .              .              =              =
ws     2  256  fwd   12.64.256/r2w  .              .              .              =              =
ws     2  64   bwd   12.128.64/r2   .              .              .              .              .
ws     2  128  bwd   12.64.128/r2   .              .              .              .              .
ws     2  192  bwd   12.64.192/r2d  .              .              .              .              .
ws     2  256  bwd   12.64.256/r2d  .              .              .              .              .
ws     1  64   fwd   16.128.64/r4v32 .              .              .              .              .
ws     1  128  fwd   12.128.128/r4w .              .              .              .              .
ws     1  256  fwd   12.64.256/r4v128s .              .              .              .              .
"""


@dataclass(frozen=True)
class Tiles:
    """One cell of TABLE."""

    num_warps: int
    block: int  # the streamed tile: BLOCK_N keys (fwd, dq) or BLOCK_M queries (dkdv, bwd)
    d_chunk: int  # output (fwd) or gradient (dkdv, dq) columns per CTA
    paired: bool = False
    ctas_per_sm: int = 1  # the launch bounds' minimum of resident CTAs: registers <= 65536 / (threads * this)
    stages: int = 0  # ws: K/V slots in its ring (the forward), q/dout slots (the fused backward)
    pipelined: bool = False
    across_turn: bool = False
    lse_by_copy: bool = False
    pack_after_wait: bool = False
    store_warps: bool = False
    pv_cols: int = 0  # the FP8 forward's P V in chunks of this many columns (0: whole)
    scores_first: bool = False
    copy_warps: int = 0  # ws: the warps that only copy and own no rows (its first warpgroup)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows(self) -> int:
        """Rows owned by the CTA: 16 per computing warp (per pair of warps when paired)."""
        return (8 if self.paired else 16) * (self.num_warps - self.copy_warps)


_FLAGS = {
    "d": "paired",
    "p": "pipelined",
    "a": "across_turn",
    "c": "lse_by_copy",
    "w": "pack_after_wait",
    "o": "store_warps",
    "s": "scores_first",
}
_COUNTS = {"x": "ctas_per_sm", "r": "stages", "v": "pv_cols"}
WS_COPY_WARPS = 4  # the warp-specialized forward's first warpgroup copies (TMA) and owns no rows


def _parse_cell(cell: str, path: str) -> Tiles:
    shape, _, flags = cell.partition("/")
    warps, block, d_chunk = (int(x) for x in shape.split("."))
    fields = {}
    i = 0
    while i < len(flags):
        letter = flags[i]
        if letter in _COUNTS:
            j = i + 1
            while j < len(flags) and flags[j].isdigit():
                j += 1
            fields[_COUNTS[letter]] = int(flags[i + 1 : j])
            i = j
        else:
            fields[_FLAGS[letter]] = True
            i += 1
    if path == "ws":
        fields["copy_warps"] = WS_COPY_WARPS
    return Tiles(warps, block, d_chunk, **fields)


def _parse(text: str) -> dict:
    cells = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        path, itemsize, head_dim, kernel, *row = line.split()
        if len(row) != len(FORMS) or kernel not in KERNELS:
            raise ValueError(f"tile table: malformed row {line!r}")
        plain = _parse_cell(row[0], path)
        for form, cell in zip(FORMS, row):
            if cell != ".":
                cells[path, int(itemsize), int(head_dim), kernel, form] = (
                    plain if cell == "=" else _parse_cell(cell, path)
                )
    return cells


CELLS = _parse(TABLE)
HEAD_DIMS = tuple(sorted({head_dim for path, _, head_dim, _, _ in CELLS if path == "mma"}))
assert HEAD_DIMS[-1] == MAX_HEAD_DIM, "the table's widest head dim is the API's"
WS_HEAD_DIMS = tuple(
    sorted({head_dim for path, size, head_dim, kernel, _ in CELLS if path == "ws" and size == 2 and kernel == "fwd"})
)
# The warp-specialized fused backward (cuda_src/attention_bwd_ws.cu): its HEAD_DIMs. Longer than CHAIN_ROWS the
# two passes serve, which sum in chunks.
WS_BWD_HEAD_DIMS = tuple(
    sorted({head_dim for path, size, head_dim, kernel, _ in CELLS if path == "ws" and size == 2 and kernel == "bwd"})
)
# The smallest head dim each warp-specialized HEAD_DIM serves, padded (ws_head_dim): padding onto the next cell beat
# the wgmma forward's own cells; the fused backward's 192 cell only from 161, where padding stops costing more
# than the two passes (docs/design/tiles.md, serving ranges).
WS_SERVES_FROM = {"fwd": {64: 33, 128: 65, 192: 129, 256: 193}, "bwd": {64: 33, 128: 65, 192: 161, 256: 193}}
assert all(
    tuple(dims) == (WS_HEAD_DIMS if kernel == "fwd" else WS_BWD_HEAD_DIMS) for kernel, dims in WS_SERVES_FROM.items()
), "a serving range for each warp-specialized HEAD_DIM"


def ws_bwd_dq_overflow(itemsize: int, head_dim: int, t: Tiles) -> int:
    """Floats per slot of a paired fused backward's dQ staging past the slot's dout tile (its kernel's
    DQ_OVERFLOW): the first consumer's share of dQ_partial's columns is whole 64-column atoms (128 of 192), more
    than the tile holds."""
    first_share = 64 * (-(-head_dim // 128) * 64)  # 64 rows x (head_dim / 2 rounded up to 64 columns)
    return max(0, first_share - t.block * head_dim * itemsize // 4)


def ws_bwd_dq_chains(t: Tiles, deterministic: bool = True) -> int:
    """The fused backward's chains of ordered dq adds per query block, each with its own float32 accumulator (its
    kernels' DQ_CHAINS), for its cell t. Where query blocks are as long as key blocks (HEAD_DIM 64: 128 and 128;
    192 and 256: 64 and 64), consecutive ranks reach a query block one step apart by arrival: two chains, so that an
    add's round trip may take two steps. One where they come two steps apart already (HEAD_DIM 128: 64 queries,
    128 keys), and for unordered adds."""
    return 2 if t.block == t.rows and deterministic else 1


# The most rows one launch of a backward pass sums a gradient over (queries for dK/dV, keys for dQ). The
# tensor cores' float32 accumulation truncates, ~2e-8 relative per 16-row step: 1.5e-4 over 2^17 rows, below
# the rounding of a float16 result, but percents over millions. Longer axes run the pass in chunks of
# CHAIN_ROWS rows whose results are added in float32 (launch.launch_summed; cuda_src/params.cuh, stream_begin).
CHAIN_ROWS = 131072
# The FP8 forward's HEAD_DIMs: the warp-specialized forward on e4m3 inputs (1-byte rows of the table).
FP8_HEAD_DIMS = tuple(sorted({head_dim for path, size, head_dim, _, _ in CELLS if path == "ws" and size == 1}))
WS_WARPGROUP_ROWS = 64  # each computing warpgroup of the warp-specialized forward owns 64 of a tile's rows
# The key tiles of 128 the warp-specialized forward's block-mask walk holds per tile, as bits in shared memory
# (cuda_src/block_mask.cuh: TILE_BITMAP_WORDS * 32); a block mask with more takes the Mods::all forward.
WS_BLOCK_MASK_TILES = 2048
PREPROCESS_WARPS = 8  # warps per CTA of the backward's preprocess (delta = rowsum(dout * out))
SMEM_PAD_BYTES = {2: 16, 4: 16, 8: 32}  # per row of a padded (mma.sync) tile, by element size: cuda_src/common.cuh
SMEM_ALIGN = 1024  # swizzled (wgmma) tiles start on this boundary: cuda_src/copy.cuh, smem_aligned
SM80_SMEM_BYTES = 163 * 1024  # dynamic shared memory an sm_80 CTA may have; a module that needs more is sm_90's


def has(path: str, itemsize: int, head_dim: int, form: str = "plain", kernel: str = "fwd") -> bool:
    """Whether the table has cells for this path, element size, HEAD_DIM, form and kernel."""
    return (path, itemsize, head_dim, kernel, form) in CELLS


def lookup(path: str, itemsize: int, head_dim: int, kernel: str, form: str) -> Tiles:
    """The cell of one kernel ("fwd", "dkdv", "dq", "bwd"; "probs" reads the forward's ``all`` cell, "dq_convert"
    the fused backward's)."""
    if kernel == "probs":
        kernel, form = "fwd", "all"
    if kernel == "dq_convert":
        kernel = "bwd"
    try:
        return CELLS[path, itemsize, head_dim, kernel, form]
    except KeyError:
        raise ValueError(
            f"no tiles for {kernel} on the {path} path for {itemsize}-byte elements at HEAD_DIM "
            f"{head_dim} in form {form!r}"
        ) from None


def padded_head_dim(d: int) -> int:
    """The smallest HEAD_DIM of the table that holds a head dim of d elements."""
    for head_dim in HEAD_DIMS:
        if d <= head_dim:
            return head_dim
    raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {d}")


def ws_head_dim(d: int, kernel: str = "fwd") -> int | None:
    """The HEAD_DIM of the warp-specialized 16-bit kernel ("fwd", or "bwd": the fused backward) that serves a head
    dim of d elements, or None: the smallest of its head dims that holds d, from WS_SERVES_FROM on (the tensor
    maps' zero fill supplies the columns past d)."""
    for head_dim, first in WS_SERVES_FROM[kernel].items():
        if d <= head_dim:
            return head_dim if d >= first else None
    return None


def preprocess_lanes(itemsize: int, head_dim: int) -> int:
    """Lanes that share one row in the backward's preprocess: one per 16-byte chunk of a HEAD_DIM-wide row,
    rounded up to a power of two, at most a warp (the rest of the warp takes further rows)."""
    chunks = head_dim * itemsize // 16
    lanes = 1
    while lanes < min(chunks, 32):
        lanes *= 2
    return lanes


def ws_q_buffers(itemsize: int, head_dim: int) -> int:
    """The warp-specialized forward's q buffers (attention_fwd_ws.cu, WsTraits::Q_BUFFERS): two where rows take
    at most 256 bytes, one past that (two 16-bit q tiles at HEAD_DIM 256 would take 128 KiB)."""
    return 2 if itemsize * head_dim <= 256 else 1


def ws_row_sum_ones_bytes(head_dim: int, block: int) -> int:
    """The 16-bit warp-specialized forward's tile of ones, whose products give P's row sums
    (wgmma.cuh, row_sum_ones_bytes): a 128-byte atom per key of a block where V's tile is one atom (head dim
    64), 512 bytes otherwise."""
    return 128 * block if head_dim == 64 else 512


def smem_bytes(path: str, itemsize: int, head_dim: int, kernel: str, t: Tiles) -> int:
    """Dynamic shared memory of one kernel with tiles t: the carve-up at the top of each kernel (swizzled
    tiles have unpadded rows and start on an SMEM_ALIGN boundary the kernel finds itself)."""
    if kernel in ("preprocess", "dq_convert"):
        return 0
    if path == "ws" and kernel == "bwd":  # BwdWsCta: K, V; q, dout and dS^T tiles; float32 dQ staging (paired:
        # the handed-over P^T and each slot's overflow, the rest staged in the slots' tiles), lse, delta
        tiles = 2 * t.rows * head_dim + 2 * t.stages * t.block * head_dim + 2 * t.rows * t.block
        staged = (
            t.rows * t.block + t.stages * ws_bwd_dq_overflow(itemsize, head_dim, t) if t.paired else t.block * head_dim
        )
        return SMEM_ALIGN + itemsize * tiles + 4 * (staged + 2 * t.stages * t.block)
    if path == "ws":  # q buffers of a tile's rows, ``stages`` slots of a K and a V tile; 16-bit: the ones
        tiles = itemsize * head_dim * (ws_q_buffers(itemsize, head_dim) * t.rows + 2 * t.stages * t.block)
        return SMEM_ALIGN + tiles + (ws_row_sum_ones_bytes(head_dim, t.block) if itemsize == 2 else 0)
    swizzled = path != "mma" and path != "large"
    row = head_dim * itemsize + (0 if swizzled else SMEM_PAD_BYTES[itemsize])
    acc_bytes = 8 if itemsize == 8 else 4
    pairs = t.num_warps // 2 if t.paired else 0
    if kernel == "fwd":  # sQ[BLOCK_M] + sK, sV[BLOCK_N] (double-buffered when swizzled)
        tiles = (t.rows + (4 if swizzled else 2) * t.block) * row
    elif kernel == "probs":  # sQ[BLOCK_M] + sK[BLOCK_N]
        tiles = (t.rows + t.block) * row
    elif kernel == "dkdv":  # sK, sV + sQ, sdO[2][BLOCK_M] + lse, delta[2][BLOCK_M]; paired: P^T per pair
        tiles = (2 * t.rows + 4 * t.block) * row + 4 * t.block * acc_bytes + pairs * (t.block // 8) * 128 * acc_bytes
    elif kernel == "dq":  # sQ, sdO + sK, sV[2][BLOCK_N]; paired: P, then dS, per pair
        tiles = (2 * t.rows + 4 * t.block) * row + pairs * (t.block // 8) * 128 * acc_bytes
    else:
        raise ValueError(f"kernel must be 'fwd', 'probs', 'dkdv', 'dq' or 'preprocess', got {kernel!r}")
    return (SMEM_ALIGN if swizzled else 0) + tiles
