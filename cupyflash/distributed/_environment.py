"""Where a process stands in a job, read from its launcher's environment: rank, world size, the rank on its own
machine, whether the job spans machines, and where rank 0 serves the rendezvous.

The launchers, in the order they are looked for (the first whose rank and size are both set wins):

    our launcher, torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR, MASTER_PORT
    Slurm (srun)            SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NNODES; rank 0's host is the
                            first of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST): Slurm starts task 0 there
    Open MPI (mpirun)       OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
    MPICH / Intel MPI       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS

The rendezvous host: ``CUPYX_DISTRIBUTED_HOST``, else ``MASTER_ADDR``, else the launcher's own convention
(Slurm's first node), else 127.0.0.1, which serves one machine only: a job that spans machines without an
address is refused with a message that says which variable to set (MPI launchers name no head node, so under
``mpirun`` across machines ``MASTER_ADDR`` must be exported, e.g. ``mpirun -x MASTER_ADDR=host0``). The port:
``CUPYX_DISTRIBUTED_PORT``, else ``MASTER_PORT``, else 13333.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 13333


@dataclass(frozen=True)
class Place:
    """A process's place in its job (module docstring): ``launcher`` names the variables it came from."""

    rank: int
    world_size: int
    local_rank: int
    spans_machines: bool
    launcher: str
    head_host: str | None = None  # rank 0's host by the launcher's own convention (Slurm), if it has one


# (launcher, rank, size, local rank, ranks on this machine, machines)
_LAUNCHERS = (
    ("RANK/WORLD_SIZE (our launcher, torchrun)", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", None),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NNODES"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", None),
    ("MPICH (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
)  # fmt: skip


def place(environ=None) -> Place | None:
    """This process's place from the first launcher whose rank and size are set; None without one."""
    environ = os.environ if environ is None else environ
    for launcher, rank_name, size_name, local_name, local_size_name, machines_name in _LAUNCHERS:
        if rank_name not in environ or size_name not in environ:
            continue
        rank, size = _integer(environ, rank_name), _integer(environ, size_name)
        if not 0 <= rank < size:
            raise ValueError(f"{launcher}: {rank_name}={rank} is not a rank of {size_name}={size} (0 .. {size - 1})")
        local = _integer(environ, local_name) if local_name in environ else rank
        if machines_name is not None and machines_name in environ:
            spans = _integer(environ, machines_name) > 1
        elif local_size_name is not None and local_size_name in environ:
            spans = _integer(environ, local_size_name) < size
        else:
            spans = False  # (without the count, as our launcher's older environments: one machine)
        head = None
        if launcher == "Slurm":
            nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
            head = first_host(nodelist) if nodelist else None
        return Place(rank, size, local, spans, launcher, head)
    return None


def rendezvous(found: Place | None, host: str | None = None, port: int | None = None, environ=None) -> tuple[str, int]:
    """(host, port) where rank 0 serves the rendezvous: the arguments, else the environment (module docstring).
    Raises where the job spans machines and nothing names rank 0's host."""
    environ = os.environ if environ is None else environ
    host = host or environ.get("CUPYX_DISTRIBUTED_HOST") or environ.get("MASTER_ADDR")
    if not host and found is not None:
        host = found.head_host
    if not host:
        if found is not None and found.spans_machines:
            raise RuntimeError(
                f"cupyflash.distributed.init: the job spans machines ({found.launcher}) but nothing names rank "
                "0's host; set MASTER_ADDR (or CUPYX_DISTRIBUTED_HOST) to it in every process, or pass host="
            )
        host = DEFAULT_HOST
    if port is None:
        text = environ.get("CUPYX_DISTRIBUTED_PORT") or environ.get("MASTER_PORT")
        port = int(text) if text else DEFAULT_PORT
    if not 0 < port < 65536:
        raise ValueError(f"the rendezvous port must be in 1 .. 65535, got {port}")
    return host, port


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list in its compact form: ``node[07-09,12],gpu3`` -> ``node07`` (a range
    keeps its zero padding)."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
    if not prefix and not ranges:
        raise ValueError(f"cannot read a host from the Slurm node list {nodelist!r}")
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def _integer(environ, name) -> int:
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the launcher's {name} must be an integer, got {text!r}") from None
