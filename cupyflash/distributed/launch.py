"""Start one process per GPU: ``python -m cupyflash.distributed.launch --nproc 2 script.py [args...]``.

Each process runs ``script.py`` with the environment that :func:`cupyflash.distributed.init` reads
(the names torchrun uses): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (its GPU), ``MASTER_ADDR`` and
``MASTER_PORT`` (where rank 0 serves the rendezvous; a free port unless ``--port`` is given). If a process
fails, the others are stopped and the launcher exits with the failed process's code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, command: list[str], port: int | None = None, host: str = "127.0.0.1") -> int:
    """Run ``command`` in ``nproc`` processes, ranks 0..nproc-1; returns the exit code (0 if all succeeded)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    port = port or free_port()
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
        )
        env.pop("CUPYX_DISTRIBUTED_PORT", None)
        env.pop("CUPYX_DISTRIBUTED_HOST", None)
        procs.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
    code = 0

    def on_signal(signum, _frame):  # SIGTERM or SIGHUP to the launcher reaches the ranks, which may sit in NCCL
        raise _Stopped(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc  # killed by signal s: the shell's 128 + s
                    _stop(procs)
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        code = code or 130
    except _Stopped as stopped:
        _stop(procs)
        code = code or stopped.code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


class _Stopped(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code


def _die_with_parent():
    """In the child before it runs: on Linux, SIGTERM when the launcher dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash.distributed.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes to start, one per GPU")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port of rank 0 (default: a free one)")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {ns.nproc}")
    return launch(ns.nproc, [sys.executable, ns.script, *ns.args], port=ns.port)


if __name__ == "__main__":
    sys.exit(main())
