"""The host's mirror of the kernels' parameter struct (cupyflash/_kernels.py, PARAMS_DTYPE) lists the fields
of ``struct AttnParams`` (cuda_src/block_info.cuh) in the same order with the same sizes: a field added to
one and not the other, or in another place, shifts every later field and the kernels read garbage."""

import re

import numpy as np

from cupyflash import _kernels

_SIZES = {"void*": 8, "float*": 8, "int*": 8, "unsigned char*": 8, "i64": 8, "int": 4, "u32": 4, "float": 4, "double": 8}


def _struct_fields():
    text = (_kernels._source_dir() / "block_info.cuh").read_text()
    body = re.search(r"struct AttnParams \{(.*?)\n\};", text, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(?:const\s+)?([\w ]+?\*?)\s*(\w+)(?:\[(\d+)\])?;", line)
        assert m, f"cannot read the field declaration {line!r}"
        ctype, name, count = m.group(1).replace(" *", "*").strip(), m.group(2), int(m.group(3) or 1)
        fields.append((name, _SIZES[ctype] * count))
    return fields


def test_host_struct_mirrors_the_kernels_struct():
    host = [(name, _kernels.PARAMS_DTYPE.fields[name][0].itemsize) for name in _kernels.PARAMS_DTYPE.names]
    assert host == _struct_fields()


def test_host_struct_is_c_aligned():
    offsets = [_kernels.PARAMS_DTYPE.fields[name][1] for name in _kernels.PARAMS_DTYPE.names]
    sizes = [_kernels.PARAMS_DTYPE.fields[name][0] for name in _kernels.PARAMS_DTYPE.names]
    for offset, dtype in zip(offsets, sizes):
        assert offset % np.dtype(dtype.base).alignment == 0
