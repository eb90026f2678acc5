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
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=host, MASTER_PORT=str(port))
        env.pop("CUPYX_DISTRIBUTED_PORT", None)
        env.pop("CUPYX_DISTRIBUTED_HOST", None)
        procs.append(subprocess.Popen(command, env=env))
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    _stop(procs)
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        code = code or 130
    return code


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
    return launch(ns.nproc, [sys.executable, ns.script, *ns.args], port=ns.port)


if __name__ == "__main__":
    sys.exit(main())
