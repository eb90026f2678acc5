"""GPT-2 small trained in bfloat16: examples/gpt (CuPy, hand-written backward, cupyflash attention, the fused
kernels) against the same model in PyTorch (examples/gpt/torch_model.py: SDPA, AdamW(fused=True), bfloat16
autocast), from the same initial weights on the same batches with the same learning-rate schedule.

Variants (``--variants``, all by default):
  ours-eager     the example's step as train.py runs it (fused kernels, one host launch per kernel);
  ours-plain     the same on the plain array code (fused.disabled()): what the fused kernels save;
  ours-graph     the step captured once as a CUDA graph and replayed (graph.CapturedStep, train.py --graph);
  torch-eager    torch_model.GPT under autocast, loss.backward(), clip_grad_norm_, fused AdamW;
  torch-compile  the same with torch.compile(model) (its first steps compile: --no-compile leaves it out).

Each variant trains --steps steps from fresh memory pools. Per variant: the step time from CUDA events recorded
around every step on the step's stream (the median of the steps after --warmup, host-bound gaps included: a
step's events are ordered with its launches), tokens per second from it, the wall-clock time per step over the
same steps, the first step's time (kernel compilation, cupyflash's plans, the capture, torch.compile), and memory:
``peak`` the most bytes in use at once during the first three steps (ours: a CuPy memory hook over every pool;
torch: max_memory_allocated), ``reserved`` what the allocators hold at the end (ours: the CuPy pools, the graph's
own included, and the cuBLAS workspace of the variant's stream, which lies outside them; torch:
max_memory_reserved, its cuBLAS workspace included). Then the losses every --log-every steps side by side, with
the largest relative difference from the reference (torch-eager where it ran, else ours-eager) at each.

Model: 12 layers, width 768, 12 heads of 64, N = 1024, batch 8, vocabulary 50304 (GPT-2's 50257 padded to a
multiple of 64, as nanoGPT and llm.c do; the same in both models). Data: the repository's documentation as
characters (examples/gpt/data.py), so only the ~120 lowest token ids occur. The two precisions differ by design:
ours keeps the residual stream in bfloat16 (each add in float32, rounded once) and the logits in float32 from the
bfloat16 product; autocast keeps the residual stream and layernorm in float32 and rounds the logits to bfloat16.

    python bench/bench_gpt.py --out bench/log/gpt-h200.json     # GPT-2 small, 200 steps per variant: minutes
    python bench/bench_gpt.py --quick --out /tmp/gpt-quick.json  # 2 layers, width 128, N 128, 30 steps
    python bench/bench_gpt.py --variants ours-eager,ours-graph --out ...

Writes the results as JSON to --out and the tables as text beside it (--out with .txt); prints the loss table, then
the step-time table last. Without torch, only our variants run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

VARIANTS = ("ours-eager", "ours-plain", "ours-graph", "torch-eager", "torch-compile")
GPT2_SMALL = dict(layers=12, width=768, heads=12, context=1024, batch=8, vocab=50304, steps=200, warmup=20)
QUICK = dict(layers=2, width=128, heads=2, context=128, batch=4, vocab=512, steps=30, warmup=5)
MEMORY_STEPS = 3  # the steps during which our memory hook counts (every step allocates alike; a graph: the first)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON results (the tables go beside it as .txt)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--no-compile", action="store_true", help="leave torch-compile out")
    parser.add_argument("--quick", action="store_true", help="a small model and 30 steps (sizes below override)")
    for name in GPT2_SMALL:
        parser.add_argument("--" + name, type=int, default=None, help=f"default {GPT2_SMALL[name]} ({QUICK[name]})")
    parser.add_argument("--lr", type=float, default=6e-4, help="the peak learning rate")
    parser.add_argument("--lr-warmup", type=int, default=None, help="steps of linear warm-up (default steps / 10)")
    parser.add_argument("--log-every", type=int, default=None, help="losses compared every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else GPT2_SMALL
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lr_warmup = max(1, args.steps // 10) if args.lr_warmup is None else args.lr_warmup
    args.log_every = max(5, args.steps // 20) if args.log_every is None else args.log_every
    args.variants = [v for v in args.variants.split(",") if v and not (args.no_compile and v == "torch-compile")]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to time")
    return args


def setup(args):
    """(config, initial parameters as float32 NumPy arrays, [(tokens, targets)] int32 host batches, one per step):
    the same for every variant."""
    from data import Text
    from model import Config, init

    config = Config(args.vocab, args.context, args.layers, args.width, args.heads)
    text = Text()
    if text.vocab > config.vocab:
        raise ValueError(f"the text has {text.vocab} characters; --vocab {config.vocab} is too small")
    rng = np.random.default_rng(args.seed)
    batches = [text.batch(rng, "train", args.batch, args.context) for _ in range(args.steps)]
    batches = [tuple(np.ascontiguousarray(a, dtype=np.int32) for a in pair) for pair in batches]
    return config, init(config, np, args.seed), batches


def learning_rate(args, step: int) -> float:
    from optim import cosine_lr

    return cosine_lr(step, peak=args.lr, warmup=args.lr_warmup, total=args.steps)


# ------------------------------------------------------------------------------------------ ours
def peak_memory_hook():
    """A CuPy memory hook that keeps ``peak``, the most bytes in use at once while it is registered, over every
    memory pool (a captured graph's own too)."""
    import cupy

    class PeakMemory(cupy.cuda.MemoryHook):
        name = "bench_gpt_peak"

        def __init__(self):
            self.used = self.peak = 0

        def malloc_postprocess(self, **kwargs):
            self.used += kwargs["mem_size"]
            self.peak = max(self.peak, self.used)

        def free_postprocess(self, **kwargs):
            self.used -= kwargs["mem_size"]

    return PeakMemory()


def run_ours(name, args, config, initial, batches) -> dict:
    import cublas_ctypes
    import cupy
    import fused
    from graph import CapturedStep
    from matmul import BFLOAT16
    from optim import AdamW
    from train import make_step

    memory = peak_memory_hook()
    memory.__enter__()  # registered until MEMORY_STEPS steps have run
    stream = cupy.cuda.Stream(non_blocking=True)
    data = [(cupy.asarray(x), cupy.asarray(y)) for x, y in batches]
    params = {k: cupy.asarray(v) for k, v in initial.items()}
    optimizer = AdamW(params, lr=args.lr)
    step = make_step(params, optimizer, config, BFLOAT16)
    captured = CapturedStep(step, (args.batch, args.context), stream=stream) if name == "ours-graph" else None
    losses = cupy.zeros(len(data), np.float32)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in data]
    hooked = True
    with fused.disabled() if name == "ours-plain" else contextlib.nullcontext(), stream:
        cupy.cuda.Device().synchronize()  # the data and parameters, made on the default stream
        began = time.perf_counter()
        for i, (x, y) in enumerate(data):
            if i == MEMORY_STEPS:
                memory.__exit__(None, None, None)
                hooked = False
            if i == args.warmup:
                stream.synchronize()
                timed_from = time.perf_counter()
            start, end = events[i]
            start.record(stream)
            optimizer.set_lr(learning_rate(args, i))
            loss, _ = captured(x, y) if captured is not None else step(x, y)
            losses[i] = loss
            end.record(stream)
            if i == 0:
                stream.synchronize()
                first_step_s = time.perf_counter() - began
        stream.synchronize()
        wall_ms = (time.perf_counter() - timed_from) * 1e3 / (len(data) - args.warmup)
    if hooked:
        memory.__exit__(None, None, None)
    pools = cupy.get_default_memory_pool().total_bytes() + (captured.pool.total_bytes() if captured else 0)
    pools += cublas_ctypes.WORKSPACE_BYTES  # every product ran on `stream`, with that stream's workspace
    step_ms = [cupy.cuda.get_elapsed_time(a, b) for a, b in events]
    return _summary(args, step_ms, wall_ms, first_step_s, losses.get(), memory.peak, pools)


# ------------------------------------------------------------------------------------------ torch
def run_torch(name, args, config, initial, batches) -> dict:
    import torch
    import torch_model

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    data = [(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()) for x, y in batches]
    net = torch_model.load(torch_model.GPT(config).cuda(), initial)
    optimizer = torch_model.adamw(net, lr=args.lr, fused=True)
    forward = torch.compile(net) if name == "torch-compile" else net
    losses = torch.zeros(len(data), device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in data]
    torch.cuda.synchronize()
    began = time.perf_counter()
    for i, (x, y) in enumerate(data):
        if i == args.warmup:
            torch.cuda.synchronize()
            timed_from = time.perf_counter()
        start, end = events[i]
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        torch_model.step(net, optimizer, learning_rate(args, i), clip=1.0)
        losses[i] = loss.detach()
        end.record()
        if i == 0:
            torch.cuda.synchronize()
            first_step_s = time.perf_counter() - began
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - timed_from) * 1e3 / (len(data) - args.warmup)
    step_ms = [a.elapsed_time(b) for a, b in events]
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return _summary(args, step_ms, wall_ms, first_step_s, losses.cpu().numpy(), peak, reserved)


def _summary(args, step_ms, wall_ms, first_step_s, losses, peak_bytes, reserved_bytes) -> dict:
    median = statistics.median(step_ms[args.warmup :])
    return dict(
        step_ms=median,
        tokens_per_s=args.batch * args.context / (median / 1e3),
        wall_ms=wall_ms,
        first_step_s=first_step_s,
        peak_bytes=int(peak_bytes),
        reserved_bytes=int(reserved_bytes),
        losses=[float(v) for v in losses],
        all_step_ms=[float(v) for v in step_ms],
    )


def release_memory() -> None:
    """Give back what the last variant's allocators hold, so that each variant's memory is its own."""
    gc.collect()
    with contextlib.suppress(ImportError):
        import cupy

        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ tables
def curve_rows(results: dict, steps: int, every: int) -> list[dict]:
    """The losses every ``every`` steps (and the last), and at each the largest relative difference of any
    variant from the reference (torch-eager if it ran, else ours-eager, else the first that ran)."""
    ran = {name: r["losses"] for name, r in results.items() if "losses" in r}
    if not ran:
        return []
    reference = next((n for n in ("torch-eager", "ours-eager") if n in ran), next(iter(ran)))
    rows = []
    for i in sorted({*range(every - 1, steps, every), steps - 1}):
        losses = {name: values[i] for name, values in ran.items()}
        ref = losses[reference]
        gaps = [abs(v - ref) / abs(ref) for name, v in losses.items() if name != reference]
        rows.append(dict(step=i + 1, losses=losses, reference=reference, max_rel_diff=max(gaps, default=0.0)))
    return rows


def tables(results: dict, rows: list[dict]) -> str:
    """The loss table, then the step-time table (last)."""
    ran = [name for name in results if "losses" in results[name]]
    lines = []
    if rows:
        lines.append(f"losses (max rel diff: from {rows[0]['reference']})")
        lines.append("| step | " + " | ".join(ran) + " | max rel diff |")
        lines.append("|---" * (len(ran) + 2) + "|")
        for row in rows:
            cells = " | ".join(f"{row['losses'][name]:.4f}" for name in ran)
            lines.append(f"| {row['step']} | {cells} | {row['max_rel_diff']:.2e} |")
        lines.append("")
    lines.append("| variant | ms/step (median) | tokens/s | wall ms/step | first step s | peak GiB | reserved GiB |")
    lines.append("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "losses" not in r:
            lines.append(f"| {name} | {r.get('error', 'not run').splitlines()[-1][:80]} | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['wall_ms']:.2f} | {r['first_step_s']:.1f} "
            f"| {r['peak_bytes'] / 2**30:.2f} | {r['reserved_bytes'] / 2**30:.2f} |"
        )
    return "\n".join(lines)


def environment() -> dict:
    found = dict(date=time.strftime("%Y-%m-%d %H:%M"))
    try:
        import cupy

        found.update(cupy=cupy.__version__, device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    except Exception as error:  # noqa: BLE001 - recorded, not fatal here
        found["cupy"] = f"unavailable: {error!r}"
    try:
        import torch

        found["torch"] = torch.__version__
    except ImportError:
        found["torch"] = None
    return found


def main(argv=None) -> dict:
    args = parse(argv)
    env = environment()
    print(env, flush=True)
    variants = args.variants
    if env["torch"] is None:
        variants = [v for v in variants if not v.startswith("torch")]
        print("torch is not installed: our variants only", flush=True)
    config, initial, batches = setup(args)
    results = {}
    for name in variants:
        release_memory()
        print(f"{name}: {args.steps} steps ...", flush=True)
        try:
            run = run_ours if name.startswith("ours") else run_torch
            results[name] = run(name, args, config, initial, batches)
            r = results[name]
            print(f"  {r['step_ms']:.2f} ms/step, loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", flush=True)
        except Exception:  # noqa: BLE001 - one variant's failure is recorded; the others still run
            results[name] = dict(error=traceback.format_exc())
            print(results[name]["error"], flush=True)
    rows = curve_rows(results, args.steps, args.log_every)
    text = tables(results, rows)
    config_dict = {k: getattr(args, k) for k in (*GPT2_SMALL, "lr", "lr_warmup", "log_every", "seed")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(environment=env, config=config_dict, results=results, curve=rows), indent=1))
    out.with_suffix(".txt").write_text(f"{env}\n{config_dict}\n\n{text}\n")
    print("\n" + text, flush=True)
    return results


if __name__ == "__main__":
    main()
