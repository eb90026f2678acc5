"""cuBLAS's gemmEx called through its C API (ctypes) on a handle of our own: matmul.py's products, run eagerly or
captured in a CUDA graph.

Why not CuPy's cublas module: each of its wrappers sets the handle's stream first and refuses any call while the
current stream is capturing (NotImplementedError), so no CuPy product, ``@`` included, can be captured. cuBLAS
itself can be captured: a gemm launches kernels on the handle's stream and, given a workspace of the caller's,
allocates nothing.

- The handle: one per device and thread (a handle must not be used by two threads at once), created on the first
  product, in host pointer mode: alpha and beta are read from host memory when the call is made (under capture,
  the values they hold then go into the graph).
- The workspace: one buffer per stream, allocated with cudaMalloc on the first product on that stream and kept
  for the process: two streams sharing one buffer could run products over it at the same time, and a graph
  replays with the address it captured. cublasSetStream resets the workspace to cuBLAS's own pool, which
  allocates, so each change of stream sets the stream's workspace again; a product on the stream set last sets
  nothing. The buffers are keyed by the stream's pointer, as CuPy's memory pool keys its free blocks: a stream
  created after another was destroyed may get its pointer, and its buffer, so let a stream's work finish before
  dropping the stream while products run elsewhere.
- The library: the libcublas that CuPy loads (importing its cublas module loads it; CuPy 14 finds it with
  cuda-pathfinder: the nvidia-cublas wheel, conda, CUDA_PATH, the system), found among the files the process has
  mapped; failing that, cuda-pathfinder's or ctypes.util's lookup.

The handles are never destroyed: at interpreter exit the CUDA context may already be gone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import threading

# cuBLAS's recommended workspace for Hopper (cublasSetWorkspace: 32 MiB; 4 MiB before Hopper suffices)
WORKSPACE_BYTES = 32 * 2**20
CUBLAS_POINTER_MODE_HOST = 0
_LIBCUBLAS = re.compile(r"libcublas\.so(\.\d+)*$")  # not libcublasLt

_lib = None
_local = threading.local()  # this thread's handles, by device


def gemm_ex(*args) -> None:
    """cublasGemmEx(handle, *args) with the current device's handle, on CuPy's current stream."""
    handle = _current_handle()
    _check(_library().cublasGemmEx(handle, *args), "cublasGemmEx")


def _current_handle() -> ctypes.c_void_p:
    """The current device's handle, its stream and workspace set to CuPy's current stream's."""
    import cupy

    handles = _local.__dict__.setdefault("handles", {})
    device = cupy.cuda.runtime.getDevice()
    handle = handles.get(device)
    if handle is None:
        handle = handles[device] = _Handle()
    handle.use(cupy.cuda.get_current_stream().ptr)
    return handle.ptr


class _Handle:
    """A cuBLAS handle on the current device, in host pointer mode, with a workspace for each stream it ran on."""

    def __init__(self):
        _refuse_under_capture("a cuBLAS handle")
        lib = _library()
        self.ptr = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate")
        _check(lib.cublasSetPointerMode_v2(self.ptr, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode")
        self.stream = None  # the stream set last (a pointer; 0 is the default stream)
        self.workspaces = {}  # stream pointer -> cupy.cuda.Memory

    def use(self, stream: int) -> None:
        if stream == self.stream:
            return
        workspace = self.workspaces.get(stream)
        if workspace is None:
            workspace = self.workspaces[stream] = _allocate_workspace()
        lib = _library()
        _check(lib.cublasSetStream_v2(self.ptr, stream), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(self.ptr, workspace.ptr, workspace.size), "cublasSetWorkspace")
        self.stream = stream


def _allocate_workspace():
    """WORKSPACE_BYTES of device memory of its own (cudaMalloc, outside CuPy's pools: a pool may be freed while a
    graph still uses the address)."""
    import cupy

    _refuse_under_capture("a cuBLAS workspace")
    try:
        return cupy.cuda.Memory(WORKSPACE_BYTES)
    except cupy.cuda.runtime.CUDARuntimeError:  # out of memory, perhaps only because CuPy's pool keeps free blocks
        cupy.get_default_memory_pool().free_all_blocks()
        return cupy.cuda.Memory(WORKSPACE_BYTES)


def _refuse_under_capture(what: str) -> None:
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():
        raise RuntimeError(
            f"{what} would be made under stream capture: the first product on a device and on a stream allocates, "
            "so run one product there before capturing (graph.CapturedStep runs its step once uncaptured first)"
        )


def _check(status: int, function: str) -> None:
    if status != 0:
        name = _library().cublasGetStatusName(status) if hasattr(_library(), "cublasGetStatusName") else None
        raise RuntimeError(f"{function} failed: {name.decode() if name else 'cuBLAS status'} ({status})")


# ------------------------------------------------------------------------------------------ the library
_SIGNATURES = {
    "cublasCreate_v2": [ctypes.POINTER(ctypes.c_void_p)],
    "cublasSetPointerMode_v2": [ctypes.c_void_p, ctypes.c_int],
    "cublasSetStream_v2": [ctypes.c_void_p, ctypes.c_void_p],
    "cublasSetWorkspace_v2": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType, algo
    "cublasGemmEx": [ctypes.c_void_p, *[ctypes.c_int] * 5, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                     ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],
}  # fmt: skip


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        path = library_path()
        lib = ctypes.CDLL(path)
        for name, argtypes in _SIGNATURES.items():
            try:
                function = getattr(lib, name)
            except AttributeError:
                raise RuntimeError(f"{path} has no {name} (cuBLAS 11.4 or later is needed)") from None
            function.argtypes, function.restype = argtypes, ctypes.c_int
        if hasattr(lib, "cublasGetStatusName"):  # cuBLAS 11.4 or later
            lib.cublasGetStatusName.argtypes, lib.cublasGetStatusName.restype = [ctypes.c_int], ctypes.c_char_p
        _lib = lib
    return _lib


def library_path() -> str:
    """The file of the libcublas that CuPy uses (or, where CuPy did not load one, that cuda-pathfinder or the
    dynamic linker's search finds); a RuntimeError saying what was tried where there is none."""
    import cupy.cuda

    tried = []
    try:
        cupy.cuda.cublas  # noqa: B018 (the import loads libcublas)
    except ImportError as exc:
        tried.append(f"CuPy's cublas module: {_one_line(exc)}")
    try:
        with open("/proc/self/maps") as maps:
            path = loaded_library(maps.read())
    except OSError:  # not Linux
        path = None
    if path is not None:
        return path
    tried.append("the libraries mapped into this process: no libcublas")
    try:
        from cuda import pathfinder

        path = pathfinder.load_nvidia_dynamic_lib("cublas").abs_path
    except Exception as exc:  # not installed, or nothing found
        tried.append(f"cuda-pathfinder: {type(exc).__name__}: {_one_line(exc)}")
    if path is None:
        path = ctypes.util.find_library("cublas")
    if path is None:
        tried.append("ctypes.util.find_library('cublas'): nothing")
        raise RuntimeError(
            "libcublas not found; install the nvidia-cublas wheel that matches CuPy's CUDA (e.g. nvidia-cublas for "
            "cupy-cuda13x, nvidia-cublas-cu12 for cupy-cuda12x) or the CUDA toolkit. Tried: " + "; ".join(tried)
        )
    return path


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def loaded_library(maps: str) -> str | None:
    """The path of the first libcublas among the lines of /proc/self/maps (``maps``: address, permissions,
    offset, device, inode, path), or None."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _LIBCUBLAS.search(os.path.basename(fields[5].strip())):
            return fields[5].strip()
    return None
