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
import os
import queue
import threading

import numpy

from cupyflash._arrays import cupy


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
        self.checked = set()  # call signatures every rank has been seen to agree on

    def exchange(self, send, recv):
        """Send ``send`` to the next rank, receive ``recv`` from the previous one, on the communication stream
        after the work queued so far on the current stream (which may still be writing ``send`` or reading
        ``recv``)."""
        from cupy.cuda import nccl

        self._stream.wait_event(cupy.cuda.get_current_stream().record())
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
        self._backend.all_gather(_bytes(x), _bytes(out), x.nbytes, cupy.cuda.get_current_stream())
        return list(out)

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

    ``group.run(fn)`` calls ``fn(comm)`` on every rank's communicator, each in its own thread, and returns
    the results in rank order; an exception on one rank stops the others and is raised here. The ring runs
    over it exactly as over NCCL: the same schedule, the same merges.
    """

    def __init__(self, world_size: int, timeout: float = 120.0):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        # (src, dst): the ring's messages; (src, -1 - dst): all-gathers, apart so that they never interleave
        self._boxes = {(src, dst): queue.Queue() for src in range(world_size)
                       for dst in list(range(world_size)) + [-1 - d for d in range(world_size)]}
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
                    raise TimeoutError(f"waited {self.timeout} s for rank {src}; does every rank make the same "
                                       "calls?") from None


class _Aborted(RuntimeError):
    pass


class _InProcessComm:
    def __init__(self, group, rank):
        self._group = group
        self.rank, self.world_size = rank, group.world_size
        self.checked = set()
        self._sent = 0  # exchanges started: each message carries its number, so waits may come in any order
        self._arrived = {}

    def exchange(self, send, recv):
        nxt = (self.rank + 1) % self.world_size
        self._group._boxes[(self.rank, nxt)].put((self._sent, [x.copy() for x in send]))
        self._sent += 1
        return (self._sent - 1, recv)

    def wait(self, pending):
        number, recv = pending
        while number not in self._arrived:
            got_number, arrays = self._group._get((self.rank - 1) % self.world_size, self.rank)
            self._arrived[got_number] = arrays
        for into, got in zip(recv, self._arrived.pop(number)):
            into[...] = got

    def all_gather(self, x):
        for dst in range(self.world_size):
            self._group._boxes[(self.rank, -1 - dst)].put(x.copy())
        return [self._group._get(src, -1 - self.rank) for src in range(self.world_size)]

    def barrier(self):
        self.all_gather(numpy.zeros(1, dtype=numpy.uint8))


def check_same_call(comm, description: str) -> None:
    """Raise on every rank unless every rank describes its call the same way; once per description."""
    if description in comm.checked:
        return
    raw = description.encode()
    digest = numpy.frombuffer(hashlib.blake2b(raw, digest_size=8).digest(), dtype=numpy.uint8).copy()
    on_device = isinstance(comm, Communicator)
    gathered = comm.all_gather(cupy.asarray(digest) if on_device else digest)
    digests = [bytes(cupy.asnumpy(d) if on_device else d) for d in gathered]
    if len(set(digests)) > 1:
        size = 1024
        text = numpy.zeros(size, dtype=numpy.uint8)
        text[:min(size, len(raw))] = numpy.frombuffer(raw[:size], dtype=numpy.uint8)
        texts = comm.all_gather(cupy.asarray(text) if on_device else text)
        lines = [bytes(cupy.asnumpy(t) if on_device else t).rstrip(b"\0").decode(errors="replace") for t in texts]
        listing = "\n".join(f"  rank {r}: {line}" for r, line in enumerate(lines))
        raise ValueError(f"the ranks' calls differ (every rank must pass shards of one shape and dtype and the "
                         f"same options):\n{listing}")
    comm.checked.add(description)


def env_rank_and_size():
    """(rank, world size, local rank) from the launcher's (or torchrun's, MPI's) environment; None if unset."""
    for rank, size, local in (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        if rank in os.environ and size in os.environ:
            r, w = int(os.environ[rank]), int(os.environ[size])
            return r, w, int(os.environ.get(local, r))
    return None


def init(backend=None, *, world_size: int | None = None, rank: int | None = None, device: int | None = None,
         host: str | None = None, port: int | None = None) -> Communicator:
    """Join the ring: pick this process's GPU and connect to the other processes through NCCL."""
    if cupy is None:
        raise ImportError("cupyflash.distributed.init needs CuPy (for NumPy arrays use InProcessGroup)")
    env = env_rank_and_size()
    if backend is not None:
        world_size = backend._n_devices if world_size is None else world_size
        rank = backend.rank if rank is None else rank
        return Communicator(backend, world_size, rank)
    if rank is None or world_size is None:
        if env is None:
            rank, world_size, local = 0, 1, 0
        else:
            rank, world_size, local = env
    else:
        local = env[2] if env else rank
    if device is None:
        device = local % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    if world_size == 1:
        return Communicator(None, 1, 0)
    import cupyx.distributed

    host = host or os.environ.get("CUPYX_DISTRIBUTED_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = port or int(os.environ.get("CUPYX_DISTRIBUTED_PORT") or os.environ.get("MASTER_PORT") or 13333)
    nccl_backend = cupyx.distributed.init_process_group(world_size, rank, host=host, port=port)
    return Communicator(nccl_backend, world_size, rank)
