"""The launcher (``python -m cupyflash.distributed.launch``) and the environment it hands to each process.

What this file proves: ``launch`` starts one process per rank with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and a MASTER_PORT shared by all ranks (CUPYX_DISTRIBUTED_* removed); a failing
rank makes it stop the others at once and return that rank's exit code; ``main`` passes the script's
arguments through; ``env_rank_and_size`` reads the launcher's (torchrun's) and Open MPI's variables. The
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
from cupyflash.distributed._comm import env_rank_and_size

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
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher or MPI variable set."""
    for name in MPI_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_rank_and_size_is_none_without_a_launcher(clean_env):
    """With none of the variables set (or a rank without a size) there is no environment to read."""
    assert env_rank_and_size() is None
    clean_env.setenv("RANK", "1")
    assert env_rank_and_size() is None


def test_env_rank_and_size_reads_the_launcher_variables(clean_env):
    """RANK, WORLD_SIZE, LOCAL_RANK; without LOCAL_RANK the local rank is the rank."""
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    assert env_rank_and_size() == (3, 8, 3)
    clean_env.setenv("LOCAL_RANK", "1")
    assert env_rank_and_size() == (3, 8, 1)


def test_env_rank_and_size_reads_open_mpi(clean_env):
    """Open MPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, when the launcher's variables are absent; the
    launcher's win when both are set."""
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "5")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "6")
    assert env_rank_and_size() == (5, 6, 5)
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert env_rank_and_size() == (5, 6, 2)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    assert env_rank_and_size() == (0, 2, 0)


def test_env_rank_and_size_reads_pmi(clean_env):
    """MPICH/Intel MPI's PMI_RANK, PMI_SIZE and MPI_LOCALRANKID."""
    clean_env.setenv("PMI_RANK", "2")
    clean_env.setenv("PMI_SIZE", "4")
    clean_env.setenv("MPI_LOCALRANKID", "0")
    assert env_rank_and_size() == (2, 4, 0)


def test_launched_environment_is_what_env_rank_and_size_reads(tmp_path):
    """Round trip: each launched rank's environment, read by env_rank_and_size's rules, gives its rank, the
    world size and its local rank."""
    script = _script(tmp_path, RECORD_ENV, names=MPI_NAMES)
    assert launcher.launch(2, [sys.executable, script]) == 0
    for rank, record in enumerate(_records(tmp_path, 2)):
        env = {k: v for k, v in record["env"].items() if v is not None}
        with pytest.MonkeyPatch.context() as mp:
            for name in MPI_NAMES:
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            assert env_rank_and_size() == (rank, 2, rank)
