"""Train the character-level GPT (model.py) on the repository's documentation (data.py), with AdamW (optim.py);
then write a checkpoint and sample text from it.

    python examples/gpt/train.py --device cpu --steps 200                  # NumPy, a tiny model, minutes
    python examples/gpt/train.py --device gpu --layers 6 --width 384 --heads 6 --context 256 --steps 2000
    python examples/gpt/train.py --resume gpt.npz --steps 400              # on from a checkpoint
    python examples/gpt/train.py --device gpu --dtype bfloat16 --graph     # each step one CUDA graph launch

A progress bar shows when tqdm is installed (an optional dependency); every --eval-every steps the validation
loss is printed. The training losses stay on the device until then: no step waits for the GPU to finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fused  # noqa: E402
from data import Text  # noqa: E402
from graph import CapturedStep  # noqa: E402
from model import Config, backward, forward, init, logits  # noqa: E402
from optim import AdamW, cosine_lr  # noqa: E402

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the activations' dtype")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="fewer than --heads: grouped-query attention")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="gpt.npz", help="written at the end ('' for none)")
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from (its model, optimizer, step)")
    parser.add_argument("--sample", type=int, default=300, help="characters to sample at the end (0: none)")
    parser.add_argument("--graph", action="store_true", help="capture one training step as a CUDA graph (GPU)")
    parser.add_argument("--plain", action="store_true", help="CuPy runs the plain array code, no fused kernels")
    args = parser.parse_args(argv)
    if args.graph and args.device != "gpu":
        parser.error("--graph needs --device gpu (a CUDA graph)")
    if args.graph and args.plain:  # (its fancy indexing in the loss has not been checked under capture)
        parser.error("--graph captures the fused kernels; the plain array code runs eagerly only")
    return args


def array_module(device: str):
    if device == "cpu":
        return np
    import cupy

    return cupy


def evaluate(params, text, config, dtype, xp, rng, batches=4, batch=16) -> float:
    """The mean validation loss over ``batches`` random batches."""
    total = 0.0
    for _ in range(batches):
        x, y = text.batch(rng, "val", batch, config.context)
        loss, _ = forward(params, xp.asarray(x), xp.asarray(y), config, dtype)
        total += float(loss)
    return total / batches


def sample(params, text, config, dtype, xp, rng, length: int, prompt: str = "\n", temperature: float = 0.8) -> str:
    """``length`` characters drawn one at a time after ``prompt`` (the model rereads its last context window)."""
    tokens = list(text.encode(prompt))
    for _ in range(length):
        window = xp.asarray(np.array(tokens[-config.context :], dtype=np.int32)[None])
        z = logits(params, window, config, dtype)[0]
        z = xp.asnumpy(z) if xp is not np else z
        p = np.exp((z - z.max()) / temperature)
        tokens.append(int(rng.choice(len(p), p=p / p.sum())))
    return text.decode(tokens[len(prompt) :])


def save(path, config, params, optimizer, step) -> None:
    """params, optimizer state, step and config in one .npz (host copies)."""
    host = {f"param.{k}": _host(v) for k, v in params.items()}
    host.update({f"opt.{k}": _host(v) for k, v in optimizer.state().items()})
    np.savez(path, step=np.array(step), config=np.array(json.dumps(config.__dict__)), **host)


def load(path, xp):
    """(config, params, optimizer state, step) of a checkpoint written by ``save``, params on ``xp``."""
    with np.load(path) as found:
        config = Config(**json.loads(str(found["config"])))
        params = {k[6:]: xp.asarray(found[k]) for k in found.files if k.startswith("param.")}
        state = {k[4:]: found[k] for k in found.files if k.startswith("opt.")}
        return config, params, state, int(found["step"])


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def make_step(params, optimizer, config, dtype):
    """One training step on device arrays (tokens, targets) -> (loss, gradients' norm), both 0-d device arrays:
    forward, backward, and AdamW at the learning rate in ``optimizer.lr``. Nothing in it waits for the device, so
    it runs as it is or captured in a CUDA graph (graph.CapturedStep). The products read the optimizer's copies of
    the matrices in ``dtype``, which it keeps up to date: change ``params`` through the optimizer only."""
    weights = optimizer.copies(dtype)

    def step(tokens, targets):
        loss, state = forward(params, tokens, targets, config, dtype, weights)
        grads = backward(state, params, config)
        return loss, optimizer.step(grads)

    return step


def setup(args, text, xp):
    """(config, params, optimizer, first step): a new model from args, or the checkpoint args.resume names."""
    if args.resume:
        config, params, state, start = load(args.resume, xp)
        optimizer = AdamW(params, lr=args.lr)
        optimizer.load(state)
        return config, params, optimizer, start
    config = Config(text.vocab, args.context, args.layers, args.width, args.heads, args.kv_heads)
    params = init(config, xp, args.seed)
    return config, params, AdamW(params, lr=args.lr), 0


def main(argv=None) -> dict:
    args = parse(argv)
    xp, dtype = array_module(args.device), DTYPES[args.dtype]
    text = Text()
    config, params, optimizer, start = setup(args, text, xp)
    rng = np.random.default_rng(args.seed + start)
    try:
        from tqdm import trange
    except ImportError:
        trange = range
    step_fn = make_step(params, optimizer, config, dtype)
    captured = CapturedStep(step_fn, (args.batch, config.context)) if args.graph else None
    history = {"train": [], "val": []}
    losses = xp.zeros(max(0, args.steps - start), np.float32)  # each step's loss, read back at evaluations
    began = time.perf_counter()
    with contextlib.ExitStack() as context:
        if args.plain:
            context.enter_context(fused.disabled())
        if captured is not None:  # one stream for the replays and everything else that touches the parameters
            context.enter_context(captured.stream)
            # The parameters, the optimizer's state (its learning rate among it) and the losses were made on the
            # default stream, which this non-blocking stream does not wait for: without this, the first set_lr
            # could run before the learning rate's initial fill and be overwritten by it.
            xp.cuda.Device().synchronize()
        for step in (bar := trange(start, args.steps)):
            x, y = text.batch(rng, "train", args.batch, config.context)
            optimizer.set_lr(cosine_lr(step, peak=args.lr, warmup=args.warmup, total=args.steps))
            loss, _ = captured(x, y) if captured is not None else step_fn(xp.asarray(x), xp.asarray(y))
            losses[step - start] = loss
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                history["train"] += _host(losses[len(history["train"]) : step + 1 - start]).tolist()
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{history['train'][-1]:.3f}")
                history["val"].append((step + 1, evaluate(params, text, config, dtype, xp, rng)))
                print(f"step {step + 1}: train {history['train'][-1]:.3f}, val {history['val'][-1][1]:.3f}", flush=True)
        seconds = time.perf_counter() - began
        if args.checkpoint:
            save(args.checkpoint, config, params, optimizer, args.steps)
        if args.sample:
            print(sample(params, text, config, dtype, xp, rng, args.sample))
    return {"history": history, "seconds": seconds, "params": params, "config": config}


if __name__ == "__main__":
    main()
