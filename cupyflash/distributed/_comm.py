"""The communicators the ring runs over: ``Communicator`` (one process per GPU, NCCL through
``cupyx.distributed``) and ``InProcessGroup`` (W ranks as threads of one process, NumPy or CuPy arrays,
for tests and for trying a schedule on a laptop).

Both offer what the ring needs and nothing more:

    rank, world_size
    exchange(send, recv) -> pending    send the arrays ``send`` to rank + 1 and fill ``recv`` from rank - 1,
                                       asynchronously (after the work queued so far)
    wait(pending)                      the received arrays may be read after this (on the GPU: the current
                                       stream waits for them; the host does not)
    all_gather(x) -> [x_0, ..., x_W-1] every rank's x, in rank order (blocking)
    barrier()                          every rank has reached it (blocking)

NCCL moves bytes: arrays travel as their raw bytes, so bfloat16 needs no NCCL type. The transfers run on a
stream of their own, so that the attention of one step overlaps the transfer of the next step's keys.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from typing import Union

import numpy

from cupyflash._arrays import cupy
from cupyflash.distributed._environment import place, rendezvous


class Communicator:
    """A ring of ``world_size`` processes, one GPU each, over a ``cupyx.distributed`` NCCL backend.

    Build it with :func:`cupyflash.distributed.init`. ``backend`` is None only for a world of one process.
    """

    def __init__(self, backend, world_size: int, rank: int):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if backend is None and world_size > 1:
            raise ValueError("a world of more than one process needs a cupyx.distributed NCCL backend")
        self.rank, self.world_size = rank, world_size
        self.device = cupy.cuda.Device().id
        self._backend = backend
        self._stream = cupy.cuda.Stream(non_blocking=True) if world_size > 1 else None

    def exchange(self, send, recv):
        """Send ``send`` to the next rank, receive ``recv`` from the previous one, on the communication stream
        after the work queued so far on the current stream (which may still be writing ``send`` or reading
        ``recv``)."""
        from cupy.cuda import nccl

        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        if not send and not recv:  # nothing this rank moves at this point (a window's skipped rows)
            return _Pending(self._stream.record(), ())
        nxt, prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        nccl.groupStart()
        try:
            for x in send:
                self._backend.send(_bytes(x), nxt, self._stream)
            for x in recv:
                self._backend.recv(_bytes(x), prev, self._stream)
        finally:
            nccl.groupEnd()
        return _Pending(self._stream.record(), (send, recv))

    def wait(self, pending):
        cupy.cuda.get_current_stream().wait_event(pending.done)

    def all_gather(self, x):
        if self.world_size == 1:
            return [x]
        x = cupy.ascontiguousarray(x)
        out = cupy.empty((self.world_size,) + x.shape, dtype=x.dtype)
        # On the communication stream, so that it is ordered after every transfer queued there (one stream
        # per communicator keeps NCCL's operations in one order on every rank).
        current = cupy.cuda.get_current_stream()
        self._stream.wait_event(current.record())
        self._backend.all_gather(_bytes(x), _bytes(out), x.nbytes, self._stream)
        current.wait_event(self._stream.record())
        return list(out)

    def gather_bytes(self, data: numpy.ndarray) -> list[bytes]:
        """Every rank's uint8 host array ``data`` (of one size), in rank order, through the communication
        stream: the host waits for the transfers queued there (which wait for the attention queued before
        them), not for attention queued after the last transfer."""
        if self.world_size == 1:
            return [data.tobytes()]
        with self._stream:
            x = cupy.asarray(data)
            out = cupy.empty((self.world_size,) + x.shape, dtype=x.dtype)
            self._backend.all_gather(x, out, x.nbytes, self._stream)
            return [row.tobytes() for row in cupy.asnumpy(out)]

    def barrier(self):
        """Every rank has reached this point (an all-gather of one byte, and a wait for it). cupyx's own
        ``barrier`` goes through its TCP store, which serves one barrier at a time."""
        if self.world_size > 1:
            self.all_gather(cupy.zeros(1, dtype=cupy.uint8))
        cupy.cuda.get_current_stream().synchronize()


class _Pending:
    __slots__ = ("done", "arrays")

    def __init__(self, done, arrays):
        self.done = done
        self.arrays = arrays  # the buffers in flight stay alive until the ring is done with them


def _bytes(x):
    """x's memory as a flat uint8 array (NCCL has no bfloat16; it moves bytes)."""
    if not x.flags.c_contiguous:
        raise ValueError(f"an array of shape {x.shape} and strides {x.strides} must be C-contiguous to travel")
    return x.reshape(-1).view(cupy.uint8)


class InProcessGroup:
    """``world_size`` ranks as threads of this process, exchanging NumPy (or CuPy) arrays through queues.

    The ring runs over it exactly as over NCCL: the same schedule, the same merges. For tests, and for
    trying a sharded computation without GPUs.

    Parameters
    ----------
    world_size : int
        The number of ranks, >= 1.
    timeout : float, optional
        Seconds a rank waits for a message before it raises (a rank that makes other calls than the rest).

    Returns
    -------
    group : InProcessGroup
        ``group.run(fn)`` calls ``fn(comm)`` on every rank's communicator, each in its own thread, and
        returns the results in rank order; an exception on one rank stops the others and is raised.
        ``group.comms[r]`` is rank r's communicator (``rank``, ``world_size``, ``barrier()``).

    Examples
    --------
    >>> from cupyflash import distributed as dist
    >>> dist.InProcessGroup(3).run(lambda comm: (comm.rank, comm.world_size))
    [(0, 3), (1, 3), (2, 3)]
    """

    def __init__(self, world_size: int, timeout: float = 120.0):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        # (src, dst): the ring's messages; (src, -1 - dst): all-gathers, apart so that they never interleave
        self._boxes = {
            (src, dst): queue.Queue()
            for src in range(world_size)
            for dst in list(range(world_size)) + [-1 - d for d in range(world_size)]
        }
        self._failed = threading.Event()
        self.comms = [_InProcessComm(self, rank) for rank in range(world_size)]

    def run(self, fn):
        results, errors = [None] * self.world_size, [None] * self.world_size

        def body(rank):
            try:
                results[rank] = fn(self.comms[rank])
            except BaseException as error:  # noqa: BLE001 (re-raised below, in the caller's thread)
                errors[rank] = error
                self._failed.set()

        threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first = next((e for e in errors if e is not None and not isinstance(e, _Aborted)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            self._failed.clear()
            for box in self._boxes.values():  # a failed run leaves nothing for the next one
                while not box.empty():
                    box.get_nowait()
            for comm in self.comms:
                comm.reset()
            raise first
        return results

    def _get(self, src, dst):
        box = self._boxes[(src, dst)]
        waited = 0.0
        while True:
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                waited += 0.05
                if self._failed.is_set():
                    raise _Aborted("another rank failed") from None
                if waited >= self.timeout:
                    raise TimeoutError(
                        f"waited {self.timeout} s for rank {src}; does every rank make the same calls?"
                    ) from None


def _snapshot(arrays):
    """Copies of ``arrays`` that another thread may read at once: CuPy copies are finished first (each
    thread may queue its work on a stream of its own)."""
    copies = [x.copy() for x in arrays]
    if any(not isinstance(x, numpy.ndarray) for x in copies):
        cupy.cuda.get_current_stream().synchronize()
    return copies


class _Aborted(RuntimeError):
    pass


class _InProcessComm:
    def __init__(self, group, rank):
        self._group = group
        self.rank, self.world_size = rank, group.world_size
        self._sent = 0  # exchanges started: each message carries its number, so waits may come in any order
        self._arrived = {}

    def reset(self):
        """Forget the messages of a failed run (the group empties its queues)."""
        self._sent = 0
        self._arrived = {}

    def exchange(self, send, recv):
        nxt = (self.rank + 1) % self.world_size
        self._group._boxes[(self.rank, nxt)].put((self._sent, _snapshot(send)))
        self._sent += 1
        return (self._sent - 1, recv)

    def wait(self, pending):
        number, recv = pending
        while number not in self._arrived:
            got_number, arrays = self._group._get((self.rank - 1) % self.world_size, self.rank)
            self._arrived[got_number] = arrays
        for into, got in zip(recv, self._arrived.pop(number)):
            into[...] = got
        if any(not isinstance(x, numpy.ndarray) for x in recv):  # the sender's copies are freed after this
            cupy.cuda.get_current_stream().synchronize()

    def all_gather(self, x):
        for dst in range(self.world_size):
            self._group._boxes[(self.rank, -1 - dst)].put(_snapshot([x])[0])
        return [self._group._get(src, -1 - self.rank) for src in range(self.world_size)]

    def gather_bytes(self, data):
        return [x.tobytes() for x in self.all_gather(data)]

    def barrier(self):
        self.all_gather(numpy.zeros(1, dtype=numpy.uint8))


# What the ring functions take as ``comm``: a GPU process's communicator, or one rank of an InProcessGroup.
Comm = Union[Communicator, _InProcessComm]


def check_same_call(comm, description: str) -> None:
    """Raise on every rank unless every rank describes its call the same way.

    Every call takes part (an 8-byte all-gather, after the transfers already queued): a rank whose call
    differs must meet the others in the same collective, whatever they called before."""
    raw = description.encode()
    digests = comm.gather_bytes(numpy.frombuffer(hashlib.blake2b(raw, digest_size=8).digest(), dtype=numpy.uint8))
    if len(set(digests)) > 1:
        text = numpy.zeros(1024, dtype=numpy.uint8)
        text[: min(text.size, len(raw))] = numpy.frombuffer(raw[: text.size], dtype=numpy.uint8)
        lines = [line.rstrip(b"\0").decode(errors="replace") for line in comm.gather_bytes(text)]
        listing = "\n".join(f"  rank {r}: {line}" for r, line in enumerate(lines))
        raise ValueError(
            f"the ranks' calls differ (every rank must pass shards of one shape and dtype and the "
            f"same options):\n{listing}"
        )


def init(
    backend: object | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    device: int | None = None,
    host: str | None = None,
    port: int | None = None,
) -> Communicator:
    """Join the ring: pick this process's GPU and connect to the other processes through NCCL.

    Parameters
    ----------
    backend : cupyx.distributed NCCLBackend, optional
        A communicator from ``cupyx.distributed.init_process_group`` to use as it is (its rank and size).
    world_size, rank : int, optional
        Default: from the launcher's environment (cupyflash/distributed/_environment.py): our launcher's
        and torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS``,
        ``SLURM_LOCALID``; Open MPI's ``OMPI_COMM_WORLD_*``; MPICH's ``PMI_RANK``, ``PMI_SIZE``,
        ``MPI_LOCALRANKID``. Without one, a world of one process. Pass both or neither; with ``backend``, they
        must be the backend's.
    device : int, optional
        This process's GPU; default its rank on its machine modulo the number of GPUs (with ``backend``: the
        current device). It becomes the current device.
    host, port : optional
        Where rank 0 serves the rendezvous; default ``CUPYX_DISTRIBUTED_HOST`` / ``MASTER_ADDR``, else under
        Slurm the first node of the step, else 127.0.0.1 (one machine only: a job across machines without an
        address raises); ``CUPYX_DISTRIBUTED_PORT`` / ``MASTER_PORT``, else 13333.

    Returns
    -------
    comm : Communicator
        ``rank``, ``world_size``, ``device``, and ``barrier()``; pass it as ``comm=`` to the ring functions.

    Examples
    --------
    In a script run by ``python -m cupyflash.distributed.launch --nproc 2 script.py``:

    >>> from cupyflash import distributed as dist        # doctest: +SKIP
    >>> comm = dist.init()                               # doctest: +SKIP
    >>> comm.rank, comm.world_size                       # doctest: +SKIP
    (0, 2)
    """
    if cupy is None:
        raise ImportError("cupyflash.distributed.init needs CuPy (for NumPy arrays use InProcessGroup)")
    env = place()
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"pass rank and world_size together, or neither (to read them from the launcher's "
            f"environment); got rank={rank!r}, world_size={world_size!r}"
        )
    if backend is not None:
        size = getattr(backend, "_n_devices", None)
        if size is None or not hasattr(backend, "rank"):
            raise TypeError(f"backend must be a cupyx.distributed NCCL backend, got {type(backend).__name__}")
        if world_size is not None and (world_size, rank) != (size, backend.rank):
            raise ValueError(
                f"rank={rank}, world_size={world_size} disagree with the backend's rank {backend.rank} of {size}"
            )
        if device is not None:
            cupy.cuda.Device(device).use()
        return Communicator(backend, size, backend.rank)
    if rank is None:
        rank, world_size, local = (env.rank, env.world_size, env.local_rank) if env is not None else (0, 1, 0)
    else:
        local = env.local_rank if env is not None else rank
    if device is None:
        device = local % _device_count()
    cupy.cuda.Device(device).use()
    if world_size == 1:
        return Communicator(None, 1, 0)
    import cupyx.distributed

    host, port = rendezvous(env, host, port)
    nccl_backend = cupyx.distributed.init_process_group(world_size, rank, host=host, port=port)
    # The rendezvous is over: creating NCCL's communicator is collective, so every rank has read the id from
    # rank 0's TCP store. The store runs in a child process that nothing stops when the interpreter exits
    # after an exception, and multiprocessing then waits for it forever: stop it now (the ring never uses
    # the store; its barrier is an NCCL all-gather).
    store = getattr(nccl_backend, "_store", None)
    if store is not None:
        store.stop()
    return Communicator(nccl_backend, world_size, rank)


def _device_count() -> int:
    """The CUDA devices this process sees; a RuntimeError that says so where there is none usable (no driver, a
    driver too old for CuPy's runtime, no device), as warmup() says it."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorInsufficientDriver, cudaErrorNoDevice, a runtime library missing
        raise RuntimeError(
            f"cupyflash.distributed.init needs a CUDA device per rank, but CUDA reports none usable "
            f"({type(exc).__name__}: {exc}); for NumPy arrays use InProcessGroup"
        ) from None
    if count < 1:
        raise RuntimeError("cupyflash.distributed.init needs a CUDA device per rank, but the CUDA driver reports none")
    return count
