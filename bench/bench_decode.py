"""Decoding from a key/value cache: cupyflash.attention_with_kvcache against torch SDPA's flash and cuDNN
back ends in the same run (torch only here, in the benchmark; never a dependency).

Every row is checked first (ours against a float64 computation of a few heads, the peers against ours),
then timed two ways, the same for every back end:
  - gpu: the calls are queued behind a spin kernel, so that the host's launch cost is hidden and the
    events time the GPU's work alone (median over repeats, per call);
  - loop: a user's loop, wall-clock time per call of back-to-back calls, host time included.
Caches smaller than 256 MB rotate among copies so that no row is timed out of the L2 cache.
Host time has its own rows: the host's cost per call on a tiny problem, ours and torch's, an empty CuPy
kernel launch for the floor, and a CUDA-graph replay of our decode step.

    python bench/bench_decode.py [--quick] [--only main,paged,nq,dims,host] [--json PATH] [--plot PATH]
    python bench/bench_decode.py --replot PATH.json --plot PATH.png   # the plot of an earlier run
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402
import dram_floor  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _timing  # noqa: E402

ROTATE_BYTES = 256 << 20


def gpu_time_us(fn, calls: int = 50, repeats: int = 7) -> float:
    """Median GPU time per call with the launches queued behind a spin kernel (host cost hidden)."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        _timing.spin(30)  # time to queue the calls
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls)
    return statistics.median(times)


def loop_time_us(fn, calls: int = 50, repeats: int = 7) -> float:
    """Median wall-clock time per call of back-to-back calls, as a user's loop sees it."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def host_time_us(fn, calls: int = 200, repeats: int = 7) -> float:
    """Median host time per call: the launches are issued behind a spin kernel, so they never wait."""
    return _timing.host_us(fn, calls=calls, repeats=repeats, spin_ms=20)


class Problem:
    """One decode step's arrays, in copies enough to rotate out of the L2 cache."""

    def __init__(self, rng, dtype, batch, hq, hk, nq, nk, d, page_size=None):
        self.dtype, self.batch, self.hq, self.hk, self.nq, self.nk, self.d = dtype, batch, hq, hk, nq, nk, d
        self.kv_bytes = 2 * batch * hk * nk * d * np.dtype(dtype).itemsize
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / self.kv_bytes)))
        self.sets = []
        for _ in range(copies):
            q = cupy.asarray(rng.standard_normal((batch, hq, nq, d), dtype=np.float32)).astype(dtype)
            k = cupy.random.standard_normal((batch, hk, nk, d), dtype=np.float32).astype(dtype)
            v = cupy.random.standard_normal((batch, hk, nk, d), dtype=np.float32).astype(dtype)
            self.sets.append(dict(q=q, k=k, v=v, paged=None))
        self.seqlens = cupy.full((batch,), nk, dtype=np.int32)
        self.page_size = page_size
        if page_size:
            pages = math.ceil(nk / page_size)
            for s in self.sets:  # the same keys and values, in pages in random order
                order = rng.permutation(batch * pages)
                table = cupy.asarray(order.reshape(batch, pages).astype(np.int32))
                padded = pages * page_size

                def paginate(x):
                    full = cupy.zeros((batch, hk, padded, d), dtype=x.dtype)
                    full[:, :, :nk] = x
                    blocks = full.reshape(batch, hk, pages, page_size, d).transpose(0, 2, 1, 3, 4)
                    out = cupy.empty((batch * pages, hk, page_size, d), dtype=x.dtype)
                    out[cupy.asarray(order)] = blocks.reshape(batch * pages, hk, page_size, d)
                    return out

                s["paged"] = (paginate(s["k"]), paginate(s["v"]), table)
                del s["k"], s["v"]
        self.turn = 0

    def next(self):
        self.turn = (self.turn + 1) % len(self.sets)
        return self.sets[self.turn]


def ours(problem: Problem):
    """Our call on one set of arrays. One query row is causal (bottom-right: it hides nothing); more rows
    run without the mask, as the peers' rows do."""
    causal = problem.nq == 1

    def run(s):
        if s["paged"] is not None:
            k, v, table = s["paged"]
            return cupyflash.attention_with_kvcache(
                s["q"], k, v, cache_seqlens=problem.seqlens, block_table=table, causal=causal
            )
        return cupyflash.attention_with_kvcache(s["q"], s["k"], s["v"], cache_seqlens=problem.seqlens, causal=causal)

    return run


def peer(problem: Problem, backend: str):
    """A torch SDPA back end on one set. No mask: SDPA's is_causal is top-left aligned, which for a decode
    step's rows would hide the cache (one query row sees everything under bottom-right alignment)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    tensors = {id(s): tuple(torch.from_dlpack(s[n]) for n in ("q", "k", "v")) for s in problem.sets}

    def run(s):
        q, k, v = tensors[id(s)]
        with sdpa_kernel([kind]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def rotating(problem: Problem, run):
    return lambda: run(problem.next())


def check(problem: Problem, rng, fns: dict) -> float:
    """Relative error of ours against float64 on one key/value head; raises if a peer disagrees with ours."""
    s = problem.sets[0]
    out = fns["ours"](s)
    group = problem.hq // problem.hk
    b, hk = int(rng.integers(problem.batch)), int(rng.integers(problem.hk))
    if s["paged"] is not None:
        k_cache, v_cache, table = s["paged"]
        pages = cupy.asnumpy(table[b])
        k = cupy.asnumpy(k_cache[pages, hk].reshape(-1, problem.d)[: problem.nk].astype(np.float64))
        v = cupy.asnumpy(v_cache[pages, hk].reshape(-1, problem.d)[: problem.nk].astype(np.float64))
    else:
        k = cupy.asnumpy(s["k"][b, hk].astype(np.float64))
        v = cupy.asnumpy(s["v"][b, hk].astype(np.float64))
    q = cupy.asnumpy(s["q"][b, hk * group : (hk + 1) * group].astype(np.float64))
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(problem.d)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = (p @ v) / p.sum(-1, keepdims=True)
    got = cupy.asnumpy(out[b, hk * group : (hk + 1) * group].astype(np.float64))
    error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    if not error < 1e-2:
        raise AssertionError(f"ours is off by {error:.2e} (relative)")
    for name, fn in fns.items():
        if name != "ours":
            theirs = cupy.from_dlpack(fn(s).contiguous()).astype(np.float64)
            gap = float(cupy.linalg.norm(theirs - out.astype(np.float64)) / cupy.linalg.norm(theirs))
            if not gap < 2e-2:
                raise AssertionError(f"{name} and ours differ by {gap:.2e} (relative)")
    return error


def row(rng, dtype, batch, nq, nk, d, hq=32, hk=8, page_size=None, peers=("flash", "cudnn"), timing=("gpu", "loop")):
    problem = Problem(rng, dtype, batch, hq, hk, nq, nk, d, page_size)
    result = dict(
        dtype=np.dtype(dtype).name,
        B=batch,
        Hq=hq,
        Hk=hk,
        Nq=nq,
        Nk=nk,
        D=d,
        page_size=page_size,
        kv_mb=problem.kv_bytes / 2**20,
    )
    runs = {"ours": ours(problem)}
    for name in peers:
        try:
            run = peer(problem, name)
            run(problem.sets[0])
            runs[name] = run
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this row is reported as such
            result[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    result["error"] = check(problem, rng, runs)
    for name, run in runs.items():
        fn = rotating(problem, run)
        if "gpu" in timing:
            result[f"{name}_gpu_us"] = gpu_time_us(fn)
        if "loop" in timing:
            result[f"{name}_loop_us"] = loop_time_us(fn)
    if "ours_gpu_us" in result:
        result["ours_tbps"] = problem.kv_bytes / (result["ours_gpu_us"] * 1e-6) / 1e12
    del problem
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def host_rows(rng):
    """Host time per call on a tiny decode step (B = 1, Hq = 32, Hk = 8, Nk = 256, D = 128)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    problem = Problem(rng, _bf16(), 1, 32, 8, 1, 256, 128)
    s = problem.sets[0]
    mine = lambda: cupyflash.attention_with_kvcache(s["q"], s["k"], s["v"], cache_seqlens=problem.seqlens)  # noqa: E731
    q, k, v = (torch.from_dlpack(s[n]) for n in ("q", "k", "v"))

    def theirs():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def theirs_plain():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    rows = dict(
        ours_host_us=host_time_us(mine),
        torch_flash_host_us=host_time_us(theirs),
        torch_default_host_us=host_time_us(theirs_plain),
        empty_cupy_launch_us=host_time_us(_timing.launch_empty),
    )
    # A decode step captured once in a CUDA graph, replayed: the host cost of a serving loop that does so.
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        mine()  # the plan and its workspace exist before capture
        stream.synchronize()
        stream.begin_capture()
        captured = mine()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        expected = mine()
        stream.synchronize()
        rows["graph_matches"] = bool(cupy.array_equal(captured, expected))
        rows["graph_replay_host_us"] = host_time_us(lambda: graph.launch(stream))
    return rows


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="main,paged,nq,dims,host")
    parser.add_argument("--plot", default=None, help="write the summary plot (PNG) here")
    parser.add_argument("--replot", default=None, help="plot an earlier run's JSON instead of measuring")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot or str(Path(args.replot).with_suffix(".png")))
        return
    rng = np.random.default_rng(0)
    bf16 = _bf16()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    device = name.decode() if isinstance(name, bytes) else name
    results = dict(device=device, rows=[])
    parts = args.only.split(",")
    floor_ms, _ = dram_floor.read_floor_ms(2 << 30, lambda fn: gpu_time_us(fn, calls=5) / 1e3)
    results["read_floor_tbps"] = (2 << 30) / floor_ms / 1e9
    print(f"DRAM read floor: {results['read_floor_tbps']:.2f} TB/s", flush=True)
    if "main" in parts:
        for batch in (8,) if args.quick else (1, 8, 64):
            for nk in (8192, 131072) if args.quick else (2048, 8192, 32768, 131072):
                if 2 * batch * 8 * nk * 128 * 2 > 40e9:
                    continue
                results["rows"].append(dict(kind="main", **row(rng, bf16, batch, 1, nk, 128)))
                print(_line(results["rows"][-1]), flush=True)
    if "paged" in parts:
        for page_size in (None, 16, 64, 256):
            results["rows"].append(
                dict(kind="paged", **row(rng, bf16, 8, 1, 32768, 128, page_size=page_size, peers=()))
            )
            print(_line(results["rows"][-1]), flush=True)
    if "nq" in parts:
        for nq in (4, 16):
            for nk in (8192, 32768):
                results["rows"].append(dict(kind="nq", **row(rng, bf16, 8, nq, nk, 128)))
                print(_line(results["rows"][-1]), flush=True)
    if "dims" in parts:
        for dtype, d in ((bf16, 64), (bf16, 256), (np.float16, 128)):
            for nk in (8192, 32768):
                results["rows"].append(dict(kind="dims", **row(rng, dtype, 8, 1, nk, d)))
                print(_line(results["rows"][-1]), flush=True)
    if "host" in parts:
        results["host"] = host_rows(rng)
        print(results["host"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    print(f"\n{device}")
    for r in results["rows"]:
        print(_line(r))


def plot(results: dict, path: str) -> None:
    """Two panels: GPU time of ours over the faster peer per row (1 = par, lower is better), and our read
    bandwidth against the DRAM read floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if any(f"{p}_gpu_us" in r for p in ("flash", "cudnn"))]
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
    labels = [
        f"{r['kind']} {short.get(r['dtype'], r['dtype'])} B{r['B']} Nq{r['Nq']} Nk{r['Nk'] // 1024}k D{r['D']}"
        for r in rows
    ]
    ratios = [r["ours_gpu_us"] / min(r[f"{p}_gpu_us"] for p in ("flash", "cudnn") if f"{p}_gpu_us" in r) for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 0.32 * len(rows) + 1.5), sharey=True)
    y = np.arange(len(rows))
    left.barh(y, ratios, color=["tab:green" if x <= 1.0 else "tab:orange" for x in ratios])
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_yticks(y, labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("GPU time, ours / faster of torch SDPA flash and cuDNN (lower is better)")
    right.barh(y, [r.get("ours_tbps", 0) for r in rows], color="tab:blue")
    right.axvline(
        results.get("read_floor_tbps", 0), color="black", linestyle="--", linewidth=0.8, label="DRAM read floor"
    )
    right.set_xlabel("ours, TB/s of the cache read")
    right.legend(loc="lower right", fontsize=7)
    figure.suptitle(f"attention_with_kvcache, {results['device']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _line(r) -> str:
    cells = [
        f"{r['kind']:5s} {r['dtype']:8s} B{r['B']:<3d} Nq{r['Nq']:<2d} Nk{r['Nk']:<6d} D{r['D']:<3d} "
        f"ps{r['page_size'] or '-':<4} {r['kv_mb']:8.0f}MB"
    ]
    for t in ("gpu", "loop"):
        ours_t = r.get(f"ours_{t}_us")
        best = min([r[f"{p}_{t}_us"] for p in ("flash", "cudnn") if f"{p}_{t}_us" in r], default=None)
        peers = " ".join(f"{p[:2]}{r[f'{p}_{t}_us']:.1f}" for p in ("flash", "cudnn") if f"{p}_{t}_us" in r)
        ratio = f" x{ours_t / best:.2f}" if best else ""
        cells.append(f"{t}: ours {ours_t:.1f} {peers}{ratio}")
    cells.append(f"{r.get('ours_tbps', 0):.2f}TB/s err{r['error']:.1e}")
    return " | ".join(cells)


if __name__ == "__main__":
    main()
