"""The host's mirror of the kernels' parameter struct (cupyflash/_kernels.py, PARAMS_DTYPE) lists the fields
of ``struct AttnParams`` (cuda_src/block_info.cuh) in the same order with the same sizes: a field added to
one and not the other, or in another place, shifts every later field and the kernels read garbage. The
same for the float32 split's ``struct SplitJobs`` (cuda_src/split_f32.cu, cupyflash/_split.py)."""

import re

import numpy as np

from cupyflash import _kernels, _split

_SIZES = {"void*": 8, "float*": 8, "int*": 8, "unsigned char*": 8, "u16*": 8, "u32*": 8, "i64": 8, "long long": 8,
          "int": 4, "u32": 4, "float": 4, "double": 8}
_COUNTS = {"SPLIT_MAX_JOBS": _split._MAX_JOBS}


def _struct_fields(filename="block_info.cuh", struct="AttnParams"):
    text = (_kernels._source_dir() / filename).read_text()
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
    host = [(name, _split._JOBS_DTYPE.fields[name][0].itemsize) for name in _split._JOBS_DTYPE.names]
    assert host == _struct_fields("split_f32.cu", "SplitJobs")


def test_host_struct_mirrors_the_kernels_struct():
    host = [(name, _kernels.PARAMS_DTYPE.fields[name][0].itemsize) for name in _kernels.PARAMS_DTYPE.names]
    assert host == _struct_fields()


def test_host_struct_is_c_aligned():
    offsets = [_kernels.PARAMS_DTYPE.fields[name][1] for name in _kernels.PARAMS_DTYPE.names]
    sizes = [_kernels.PARAMS_DTYPE.fields[name][0] for name in _kernels.PARAMS_DTYPE.names]
    for offset, dtype in zip(offsets, sizes):
        assert offset % np.dtype(dtype.base).alignment == 0
