"""The warp-specialized forward's main loop in SASS: instructions per key block, by kind, against the clocks its
products take, for the FP8 and 16-bit forms. No GPU needed: each variant is compiled through NVRTC for sm_90a and
disassembled with nvdisasm (from the CUDA toolkit, or the ``nvidia-cuda-nvdisasm`` wheel; ``--nvdisasm PATH``).

A computing warpgroup's loop body handles one key block of its 64 query rows: two products (S = q k^T and
O += P v, 4 x 64 x BLOCK_N x D FLOPs), and a softmax of 64 x BLOCK_N scores. What the body issues competes for each
scheduler's one instruction per clock; the special-function unit takes 16 exponentials per clock per SM (a
warp's MUFU occupies its scheduler's quarter of the unit for 8 clocks); the tensor cores take 4,096 bf16 or 8,192
e4m3 FLOPs per clock per SM. With the SM's computing warps all in their loop, one key block of every computing
warpgroup costs, per SM:

    tensor clocks   = warpgroups x 4 x 64 x BLOCK_N x D / (FLOPs per clock)
    issue clocks    = warps per scheduler x instructions in the body
    exponential clk = warps per scheduler x MUFU.EX2 in the body x 8

The largest of the three is the loop's floor; the kernel reaches its TFLOP/s ceiling only where the tensor clocks
are the largest and the others hide under them. Prints a table per variant; writes JSON with ``--json``.

    python bench/exp/18_fwd_sass_loop.py [--nvdisasm PATH] [--dims 64,128,256] [--json PATH]
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cupyflash._cuda import (
    tile_policy,  # noqa: E402
    tiles,  # noqa: E402
)
from cupyflash._cuda.ptxas_report import OPTIONS, _nvrtc  # noqa: E402
from cupyflash._cuda.variants import Variant  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
parser.add_argument("--dims", default="64,128,256")
parser.add_argument("--json", default=None)
parser.add_argument("--keep", default=None, help="a folder to keep each variant's SASS in")
args = parser.parse_args()

FLOPS_PER_CLOCK = {1: 8192, 2: 4096}  # dense tensor-core FLOPs per clock per SM on Hopper, by input itemsize
MUFU_CLOCKS = 8  # one warp's MUFU on its scheduler's quarter of the special-function unit (16 per clock per SM)


def cubin(variant: Variant) -> bytes:
    """The variant's forward module compiled for sm_90a, as NVRTC's cubin."""
    nvrtc = _nvrtc()
    (kernels,) = variant.sources
    code = variant.code(kernels)
    program = nvrtc.createProgram(code, "fwd.cu", [], [])
    try:
        for kernel in kernels:
            name = variant.name_expression(kernel)
            if "<" in name:
                nvrtc.addNameExpression(program, name)
        nvrtc.compileProgram(program, [*OPTIONS, f"-arch={variant.compile_targets()['sm_90']}"])
        image = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    # CuPy's getCUBIN drops the image's trailing NUL bytes; the ELF header says how long it is (the program
    # headers come last), and nvdisasm refuses an image cut short.
    phoff = int.from_bytes(image[0x20:0x28], "little")
    phentsize, phnum = (int.from_bytes(image[at : at + 2], "little") for at in (0x36, 0x38))
    return image.ljust(phoff + phentsize * phnum, b"\0")


def sass(variant: Variant) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "fwd.cubin")
        Path(path).write_bytes(cubin(variant))
        return subprocess.run([args.nvdisasm, "-c", path], check=True, capture_output=True, text=True).stdout


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^\s*(\.L\w+):")
TARGET = re.compile(r"(\.L\w+)")


def functions(text: str) -> dict[str, list]:
    """kernel symbol -> its instructions as (opcode, operands, predicated, labels placed before it)."""
    found, current, labels = {}, None, []
    for raw in text.splitlines():
        header = re.match(r"\s*\.text\.(\S+):", raw)
        if header:
            current, labels = found.setdefault(header.group(1), []), []
            continue
        lab = LABEL.match(raw)
        if lab:
            labels.append(lab.group(1))
            continue
        m = LINE.search(raw)
        if m and current is not None:
            current.append((m.group(3), m.group(4), bool(m.group(2)), labels))
            labels = []
    return found


def label_index(instrs) -> dict[str, int]:
    return {lab: i for i, (_, _, _, labs) in enumerate(instrs) for lab in labs}


def loops(instrs):
    """Every backward branch's loop: (first index, last index) of the instructions from its target to it."""
    where = label_index(instrs)
    found = []
    for i, (op, operands, _, _) in enumerate(instrs):
        target = TARGET.search(operands) if op.startswith("BRA") else None
        if target and target.group(1) in where and where[target.group(1)] <= i:
            found.append((where[target.group(1)], i))
    return found


def paths(instrs, lo, hi):
    """The fewest and the most instructions one trip through the loop [lo, hi] can issue, with their counts by
    kind: over its forward branches (a branch to an earlier address inside it, such as a barrier's retry,
    counts as not taken; one that leaves the loop ends no trip)."""
    where = label_index(instrs)
    leaders = {lo, hi + 1}
    for i in range(lo, hi + 1):
        op, operands, _, _ = instrs[i]
        if op.startswith(("BRA", "EXIT", "RET")):
            leaders.add(i + 1)
            target = TARGET.search(operands)
            if target and lo <= where.get(target.group(1), -1) <= hi:
                leaders.add(where[target.group(1)])
    starts = sorted(x for x in leaders if lo <= x <= hi)
    best = {hi + 1: (collections.Counter(), collections.Counter())}  # block start -> (fewest, most) to the end
    for a, b in reversed(list(zip(starts, starts[1:] + [hi + 1]))):
        own = collections.Counter(kind(instrs[i][0]) for i in range(a, b))
        op, operands, predicated, _ = instrs[b - 1]
        nexts = []
        if b - 1 == hi:
            nexts = [hi + 1]  # the back edge: one trip done
        elif op.startswith("BRA"):
            target = TARGET.search(operands)
            t = where.get(target.group(1), -1) if target else -1
            if t > b - 1 and t <= hi + 1:
                nexts.append(t)
            if predicated or t <= b - 1:
                nexts.append(b)
        elif op.startswith(("EXIT", "RET")):
            nexts = []
        else:
            nexts = [b]
        options = [best[n] for n in nexts if n in best]
        if not options:
            continue
        fewest = min((o[0] for o in options), key=lambda c: sum(c.values()))
        most = max((o[1] for o in options), key=lambda c: sum(c.values()))
        best[a] = (own + fewest, own + most)
    return best[lo]


def kind(op: str) -> str:
    base = op.split(".")[0]
    if base in ("HGMMA", "QGMMA"):
        return "GMMA"
    if op.startswith("MUFU.EX2"):
        return "MUFU.EX2"
    if base == "MUFU":
        return "MUFU other"
    if base in ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "F2FP", "PRMT", "SHFL"):
        return base
    if base in ("WARPGROUP", "WARPSYNC", "BAR", "SYNCS", "DEPBAR", "ARRIVES", "NOP"):
        return "sync / wait"
    if base.startswith("U"):
        return "uniform"
    return "other"


def main_loop(instrs):
    """The computing warpgroups' key-block loop: the innermost loop holding both GMMAs and exponentials."""
    found = None
    for lo, hi in loops(instrs):
        ops = [op for op, _, _, _ in instrs[lo : hi + 1]]
        if any(kind(op) == "GMMA" for op in ops) and any(op.startswith("MUFU.EX2") for op in ops):
            if found is None or hi - lo < found[1] - found[0]:
                found = (lo, hi)
    return found


def report(label: str, variant: Variant) -> dict:
    text = sass(variant)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        (Path(args.keep) / f"{label}.sass").write_text(text)
    t = variant.tiles("fwd")
    found = [(symbol, instrs, main_loop(instrs)) for symbol, instrs in functions(text).items()]
    found = [(symbol, instrs, loop) for symbol, instrs, loop in found if loop is not None]
    if len(found) != 1:
        raise SystemExit(f"{label}: {len(found)} kernels with a loop of both GMMA and MUFU.EX2, one expected")
    symbol, instrs, (lo, hi) = found[0]
    fewest, most = paths(instrs, lo, hi)
    warpgroups = (t.num_warps - t.copy_warps) // 4  # computing; each spreads its 4 warps over the 4 schedulers
    rows_per_wg, block_n = 64, t.block
    tensor = warpgroups * 4 * rows_per_wg * block_n * variant.head_dim / FLOPS_PER_CLOCK[variant.itemsize]
    scores_per_thread = rows_per_wg * block_n // 128
    out = {
        "variant": label,
        "kernel": symbol,
        "block_n": block_n,
        "computing_warpgroups": warpgroups,
        "static_body": hi - lo + 1,
        "fewest": dict(fewest),
        "most": dict(most),
        "scores_per_thread": scores_per_thread,
        "tensor_clocks": tensor,
    }
    print(
        f"\n{label}: {warpgroups} computing warpgroups of 64 rows, {block_n}-key blocks ({scores_per_thread} scores "
        f"a thread), loop {hi - lo + 1} instructions in SASS; per key block of every computing warpgroup, per SM:"
    )
    print(f"  tensor cores {tensor:6.0f} clk")
    for name, counts in (("fewest", fewest), ("most", most)):
        body = sum(counts.values())
        issue = warpgroups * body
        exps = warpgroups * counts["MUFU.EX2"] * MUFU_CLOCKS
        out[f"issue_clocks_{name}"], out[f"exp_clocks_{name}"] = issue, exps
        print(
            f"  {name:6s} path: {body:4d} instructions ({body / scores_per_thread:5.2f} a score) "
            f"-> issue {issue:6.0f} clk "
            f"({issue / tensor:.2f}x the tensor cores'), exponentials {exps:6.0f} clk ({exps / tensor:.2f}x)"
        )
        print("    " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return out


results = []
for d in [int(x) for x in args.dims.split(",")]:
    if d in tiles.FP8_HEAD_DIMS:
        results.append(report(f"fp8-d{d}", tile_policy.fp8(d, False, "bfloat16")))
    results.append(report(f"bf16-d{d}", Variant("fwd", "bfloat16", d, "ws")))
if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
