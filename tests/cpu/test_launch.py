"""The launcher (``python -m cupyflash.distributed.launch``) and the environment it hands to each process.

What this file proves: ``launch`` starts one process per rank with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and a MASTER_PORT shared by all ranks (CUPYX_DISTRIBUTED_* removed); a failing
rank makes it stop the others at once and return that rank's exit code; ``main`` passes the script's
arguments through; ``_environment.place`` reads our launcher's (torchrun's), Slurm's, Open MPI's and MPICH's
variables, and ``rendezvous`` finds rank 0's address. The
scripts run here import nothing but the standard library: no CuPy, no GPU.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cupyflash.distributed import launch as launcher
from cupyflash.distributed._environment import first_host, place, rendezvous

ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUPYX_DISTRIBUTED_PORT",
    "CUPYX_DISTRIBUTED_HOST",
)
RECORD_ENV = """\
    import json, os, sys
    names = {names!r}
    record = dict(env={{n: os.environ.get(n) for n in names}}, argv=sys.argv[1:])
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(record, f)
"""


def _script(tmp_path, body, **fields):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body).format(out=str(tmp_path), **fields))
    return str(path)


def _records(tmp_path, nproc):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_every_rank_runs_with_the_launcher_environment(tmp_path, monkeypatch):
    """launch(2, ...) runs the script twice, as ranks 0 and 1 of 2, on one MASTER_ADDR and MASTER_PORT; it
    drops CUPYX_DISTRIBUTED_PORT/HOST (which would override MASTER_*) and returns 0."""
    monkeypatch.setenv("CUPYX_DISTRIBUTED_PORT", "1")
    monkeypatch.setenv("CUPYX_DISTRIBUTED_HOST", "elsewhere")
    script = _script(tmp_path, RECORD_ENV, names=ENV_NAMES)
    assert launcher.launch(2, [sys.executable, script]) == 0
    envs = [record["env"] for record in _records(tmp_path, 2)]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "2", "0", "2"),
        ("1", "2", "1", "2"),
    ]
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == "127.0.0.1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0
    assert all(e["CUPYX_DISTRIBUTED_PORT"] is None and e["CUPYX_DISTRIBUTED_HOST"] is None for e in envs)


def test_a_given_port_and_host_reach_every_rank(tmp_path):
    """launch(..., port=, host=) hands that port and host to every rank."""
    script = _script(tmp_path, RECORD_ENV, names=ENV_NAMES)
    assert launcher.launch(3, [sys.executable, script], port=23456, host="localhost") == 0
    envs = [record["env"] for record in _records(tmp_path, 3)]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("localhost", "23456")}
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]


def test_a_failing_rank_stops_the_others(tmp_path):
    """Rank 1 exits with 3 while rank 0 would sleep 30 s: launch returns 3 within seconds, having sent rank 0
    SIGTERM (its handler records it) and waited for it."""
    script = _script(
        tmp_path,
        """\
        import os, signal, sys, time
        out, rank = {out!r}, os.environ["RANK"]
        if rank == "0":
            def stopped(signum, frame):
                open(os.path.join(out, "rank0_stopped"), "w").close()
                sys.exit(0)
            signal.signal(signal.SIGTERM, stopped)
            open(os.path.join(out, "rank0_ready"), "w").close()
            time.sleep(30)
            open(os.path.join(out, "rank0_finished"), "w").close()
        else:
            deadline = time.time() + 20
            while not os.path.exists(os.path.join(out, "rank0_ready")) and time.time() < deadline:
                time.sleep(0.01)
            sys.exit(3)
    """,
    )
    start = time.perf_counter()
    assert launcher.launch(2, [sys.executable, script]) == 3
    assert time.perf_counter() - start < 15
    assert (tmp_path / "rank0_stopped").exists() and not (tmp_path / "rank0_finished").exists()


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    """A launcher stopped by SIGTERM (a job scheduler, a test's timeout) stops its ranks, which could otherwise
    sit in NCCL holding the GPUs, and exits with 128 + 15."""
    script = _script(
        tmp_path,
        """\
        import os, time
        open(os.path.join({out!r}, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(60)
    """,
    )
    proc = subprocess.Popen([sys.executable, "-m", "cupyflash.distributed.launch", "--nproc", "2", script])
    deadline = time.time() + 20
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    proc.terminate()
    assert proc.wait(timeout=20) == 143
    for pid in pids:
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"rank process {pid} outlived the launcher")


def test_main_passes_the_script_arguments_through(tmp_path):
    """main(["--nproc", "2", script, "arg", "--flag", "x"]) runs ``script arg --flag x`` on both ranks (the
    launcher's own options stop at the script)."""
    script = _script(tmp_path, RECORD_ENV, names=ENV_NAMES)
    assert launcher.main(["--nproc", "2", script, "arg", "--flag", "x"]) == 0
    assert [record["argv"] for record in _records(tmp_path, 2)] == [["arg", "--flag", "x"]] * 2


def test_module_entry_point_exits_with_the_script_code(tmp_path):
    """``python -m cupyflash.distributed.launch --nproc 1 script`` exits with the script's exit code."""
    script = _script(tmp_path, "import sys; sys.exit(5)\n")
    done = subprocess.run([sys.executable, "-m", "cupyflash.distributed.launch", "--nproc", "1", script], timeout=60)
    assert done.returncode == 5


def test_nproc_must_be_positive():
    """launch(0, ...) raises ValueError before starting anything."""
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        launcher.launch(0, [sys.executable, "-c", "pass"])


def test_free_port_is_a_bindable_port():
    """free_port returns a port number in the unprivileged range."""
    assert 1024 <= launcher.free_port() < 65536


MPI_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NNODES",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _at(**environ):
    """(rank, world size, local rank, spans machines, launcher) of the place this environment gives."""
    found = place({name: str(value) for name, value in environ.items()})
    return None if found is None else (found.rank, found.world_size, found.local_rank, found.spans_machines,
                                       found.launcher)  # fmt: skip


def test_no_launcher_is_no_place():
    """With none of the variables set (or a rank without a size) there is no place to read."""
    assert _at() is None
    assert _at(RANK=1) is None
    assert _at(SLURM_PROCID=1) is None


def test_our_launcher_and_torchrun():
    """RANK, WORLD_SIZE, LOCAL_RANK; without LOCAL_RANK the local rank is the rank; LOCAL_WORLD_SIZE below
    WORLD_SIZE means more than one machine."""
    assert _at(RANK=3, WORLD_SIZE=8)[:4] == (3, 8, 3, False)
    assert _at(RANK=3, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=8)[:4] == (3, 8, 1, False)
    assert _at(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4)[:4] == (5, 8, 1, True)


def test_slurm():
    """srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NNODES; rank 0's host is the step's first node."""
    environ = dict(SLURM_PROCID=3, SLURM_NTASKS=4, SLURM_LOCALID=1, SLURM_NNODES=2,
                   SLURM_STEP_NODELIST="gpu[007-008]", SLURM_JOB_NODELIST="gpu[001-009]")  # fmt: skip
    assert _at(**environ) == (3, 4, 1, True, "Slurm")
    found = place({name: str(value) for name, value in environ.items()})
    assert found.head_host == "gpu007"
    assert rendezvous(found, environ={}) == ("gpu007", 13333)
    del environ["SLURM_STEP_NODELIST"]
    assert place({name: str(value) for name, value in environ.items()}).head_host == "gpu001"
    # RANK and WORLD_SIZE set in a Slurm script (torchrun inside srun) win over Slurm's own
    assert _at(**environ, RANK=0, WORLD_SIZE=2)[:3] == (0, 2, 0)


def test_open_mpi_and_mpich():
    """Open MPI's OMPI_COMM_WORLD_* and MPICH's PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS."""
    assert _at(OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=6) == (5, 6, 5, False, "Open MPI")
    assert _at(OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=6, OMPI_COMM_WORLD_LOCAL_RANK=2,
               OMPI_COMM_WORLD_LOCAL_SIZE=3)[:4] == (5, 6, 2, True)  # fmt: skip
    assert _at(PMI_RANK=2, PMI_SIZE=4, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=4) == (2, 4, 0, False, "MPICH (PMI)")


def test_bad_launcher_values_say_which():
    with pytest.raises(ValueError, match=r"SLURM_PROCID=4 is not a rank of SLURM_NTASKS=4 \(0 .. 3\)"):
        _at(SLURM_PROCID=4, SLURM_NTASKS=4)
    with pytest.raises(ValueError, match=r"the launcher's WORLD_SIZE must be an integer, got 'two'"):
        _at(RANK=0, WORLD_SIZE="two")


def test_rendezvous_address():
    """The arguments, else CUPYX_DISTRIBUTED_HOST / MASTER_ADDR, else the launcher's head node, else 127.0.0.1;
    across machines with no address it raises, naming the variable to set."""
    one_machine = place({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert rendezvous(one_machine, environ={}) == ("127.0.0.1", 13333)
    assert rendezvous(one_machine, environ={"MASTER_ADDR": "h0", "MASTER_PORT": "2900"}) == ("h0", 2900)
    assert rendezvous(one_machine, environ={"CUPYX_DISTRIBUTED_HOST": "h1", "MASTER_ADDR": "h0"})[0] == "h1"
    assert rendezvous(one_machine, "h2", 3000, environ={"MASTER_ADDR": "h0"}) == ("h2", 3000)
    across = place({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    with pytest.raises(RuntimeError, match=r"spans machines \(Open MPI\).*set MASTER_ADDR"):
        rendezvous(across, environ={})
    assert rendezvous(across, environ={"MASTER_ADDR": "h0"}) == ("h0", 13333)
    with pytest.raises(ValueError, match="port must be in 1 .. 65535"):
        rendezvous(one_machine, port=70000, environ={})


@pytest.mark.parametrize(
    "nodelist, host",
    [("node07", "node07"), ("node[07-09,12],gpu3", "node07"), ("nid[001234-001240]", "nid001234"),
     ("a,b", "a"), ("rack1-n[3,5]-ib", "rack1-n3-ib")],
)  # fmt: skip
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_launched_environment_is_what_place_reads(tmp_path):
    """Round trip: each launched rank's environment, read by place's rules, gives its rank, the world size and
    its local rank, on one machine, with rank 0's address and port."""
    script = _script(tmp_path, RECORD_ENV, names=MPI_NAMES)
    assert launcher.launch(2, [sys.executable, script]) == 0
    for rank, record in enumerate(_records(tmp_path, 2)):
        env = {k: v for k, v in record["env"].items() if v is not None}
        found = place(env)
        assert (found.rank, found.world_size, found.local_rank, found.spans_machines) == (rank, 2, rank, False)
        assert rendezvous(found, environ=env) == ("127.0.0.1", int(env["MASTER_PORT"]))
