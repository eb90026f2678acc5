"""The host's mirror of the kernels' parameter struct (cupyflash/_cuda/params.py, PARAMS_DTYPE) lists the
fields of ``struct AttnParams`` (cuda_src/params.cuh) in the same order with the same sizes: a field added to
one and not the other, or in another place, shifts every later field and the kernels read garbage. The
same for the float32 split's ``struct SplitJobs`` (cuda_src/split_f32.cu, cupyflash/_cuda/f32_pieces.py) and the
decode kernels' ``struct KVCacheParams`` (cuda_src/kvcache.cuh, cupyflash/_cuda/decode_params.py)."""

import re

import numpy as np

from cupyflash._checks import MAX_SPLITS
from cupyflash._cuda import decode_params, f32_pieces, launch, params
from cupyflash._cuda.source import source_dir

_SIZES = {
    "void*": 8,
    "float*": 8,
    "int*": 8,
    "unsigned char*": 8,
    "u16*": 8,
    "u32*": 8,
    "i64": 8,
    "long long": 8,
    "int": 4,
    "u32": 4,
    "float": 4,
    "double": 8,
}
_COUNTS = {"SPLIT_MAX_JOBS": f32_pieces._MAX_JOBS}


def _struct_fields(filename="params.cuh", struct="AttnParams"):
    text = (source_dir() / filename).read_text()
    body = re.search(r"struct " + struct + r" \{(.*?)\n\};", text, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(?:const\s+)?([\w ]+?\*?)\s*(\w+)(?:\[(\w+)\])?;", line)
        assert m, f"cannot read the field declaration {line!r}"
        ctype, name, count = m.group(1).replace(" *", "*").strip(), m.group(2), m.group(3) or "1"
        fields.append((name, _SIZES[ctype] * int(_COUNTS.get(count, count))))
    return fields


def test_split_jobs_mirror_the_kernels_struct():
    host = [(name, f32_pieces._JOBS_DTYPE.fields[name][0].itemsize) for name in f32_pieces._JOBS_DTYPE.names]
    assert host == _struct_fields("split_f32.cu", "SplitJobs")


def test_host_struct_mirrors_the_kernels_struct():
    host = [(name, params.PARAMS_DTYPE.fields[name][0].itemsize) for name in params.PARAMS_DTYPE.names]
    assert host == _struct_fields()


def test_host_struct_is_c_aligned():
    offsets = [params.PARAMS_DTYPE.fields[name][1] for name in params.PARAMS_DTYPE.names]
    sizes = [params.PARAMS_DTYPE.fields[name][0] for name in params.PARAMS_DTYPE.names]
    for offset, dtype in zip(offsets, sizes):
        assert offset % np.dtype(dtype.base).alignment == 0


def test_the_launch_arguments_are_the_structs_bytes():
    """A launch passes the struct as one opaque value of its size; a plan writes addresses as 64-bit words at
    the fields' offsets."""
    assert params.PARAMS_BYTES.itemsize == params.PARAMS_DTYPE.itemsize
    assert f32_pieces._JOBS_BYTES.itemsize == f32_pieces._JOBS_DTYPE.itemsize
    for name, word in launch._ADDRESS_WORDS.items():
        if name.startswith("fp8_descale_"):  # an element of the array of q's, k's and v's descale tables
            base, offset = params.PARAMS_DTYPE.fields["fp8_descale"][:2]
            assert base.base == np.dtype(np.uint64) and base.shape == (3,)
            offset += 8 * "qkv".index(name[-1])
        else:
            base, offset = params.PARAMS_DTYPE.fields[name][:2]
            assert base == np.dtype(np.uint64), name
        assert offset == 8 * word, name
    keys, offset = params.PARAMS_DTYPE.fields["dropout_keys"][:2]
    assert keys.base == np.dtype(np.uint32) and keys.shape == (20,)
    assert launch.KEY_WORDS == slice(offset // 4, offset // 4 + 20)


def test_kvcache_struct_mirrors_the_kernels_struct():
    host = [(name, decode_params.PARAMS_DTYPE.fields[name][0].itemsize) for name in decode_params.PARAMS_DTYPE.names]
    assert host == _struct_fields("kvcache.cuh", "KVCacheParams")
    assert decode_params.PARAMS_BYTES.itemsize == decode_params.PARAMS_DTYPE.itemsize
    for name, word in decode_params.WORD.items():
        base, offset = decode_params.PARAMS_DTYPE.fields[name][:2]
        assert base == np.dtype(np.uint64) and offset == 8 * word, name


def test_the_split_limit_is_the_kernels():
    """The merge's shared memory holds MAX_SPLITS weights a row: the host must never ask for more."""
    text = (source_dir() / "kvcache.cuh").read_text()
    assert int(re.search(r"constexpr int MAX_SPLITS = (\d+);", text).group(1)) == MAX_SPLITS
