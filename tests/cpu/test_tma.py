"""TMA tensor maps of q, k and v for the warp-specialized forward (cupyflash/_cuda/tma.py), without a GPU: which
layouts a map can describe, and that each set of addresses is encoded once (the driver's encoder stood in for)."""

import numpy as np
import pytest

from cupyflash._cuda import tma


class _FakeArray:
    def __init__(self, shape, strides, ptr=1 << 20, itemsize=2):
        self.shape, self.strides = shape, strides
        self.dtype = np.dtype(np.float16) if itemsize == 2 else np.dtype(np.float32)
        self.data = type("Pointer", (), {"ptr": ptr})()


def test_tensor_maps_describe_aligned_strided_inputs_and_broadcast_ones_where_asked():
    """tma.describable: a 16-byte aligned start and strides, and no batch dim of several entries at stride 0
    unless ``broadcast`` (k and v shared by a group of query heads)."""
    dense = _FakeArray((2, 3, 100, 128), (2 * 3 * 100 * 256, 3 * 100 * 256, 256, 2))
    assert tma.describable(dense, [1, 2, 3], [0, 300 * 128, 100 * 128])
    sliced = _FakeArray((2, 3, 100, 128), (2 * 3 * 100 * 272, 3 * 100 * 272, 272, 2))  # rows of 136 elements
    assert tma.describable(sliced, [1, 2, 3], [0, 300 * 136, 100 * 136])
    assert not tma.describable(dense, [1, 2, 3], [0, 300 * 128, 0])  # heads broadcast
    assert tma.describable(dense, [1, 2, 3], [0, 300 * 128, 0], broadcast=True)
    assert not tma.describable(sliced, [1, 2, 3], [0, 300 * 136 + 4, 0], broadcast=True)  # misaligned all the same
    assert tma.describable(dense, [1, 1, 3], [0, 0, 100 * 128])  # a dim of one entry: any stride
    assert not tma.describable(
        _FakeArray((2, 100, 128), (100 * 256, 256, 2), ptr=(1 << 20) + 8), [1, 1, 2], [0, 0, 100 * 128]
    )
    assert not tma.describable(_FakeArray((2, 100, 128), (100 * 264, 264, 2)), [1, 1, 2], [0, 0, 100 * 132])


def test_tensor_maps_are_encoded_once_per_set_of_addresses(monkeypatch):
    """TensorMaps.encode: the maps of q, k, v in order, each at a 64-byte aligned address of the argument's
    bytes; a call with the previous call's addresses returns the previous argument without encoding, any
    other encodes every map again. (A stand-in for the driver's encoder writes each map's address and its
    rows of box.)"""
    import ctypes

    calls = []

    def encode(at, code, rank, address, dims, strides, box, element_strides, *flags):
        calls.append((at % 64, address))
        words = (ctypes.c_uint64 * 16)(address, box[1], *([0] * 14))
        ctypes.memmove(at, words, tma.MAP_BYTES)
        return 0

    monkeypatch.setattr(tma, "_encoder", lambda: encode)
    dense = _FakeArray((2, 3, 100, 128), (2 * 3 * 100 * 256, 3 * 100 * 256, 256, 2))
    arrays = {"q": dense, "k": dense, "v": dense}
    strides = {name: [0, 300 * 128, 100 * 128] for name in arrays}
    maps = tma.TensorMaps(arrays, [1, 2, 3], strides, {"q": 64, "k": 32, "v": 32})
    first = maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 3 << 20})
    assert [offset for offset, _ in calls] == [0, 0, 0] and len(calls) == 3
    assert first.dtype.itemsize == 3 * tma.MAP_BYTES and first.shape == (1,)
    words = first.view(np.uint64).reshape(3, 16)
    assert words[:, 0].tolist() == [1 << 20, 2 << 20, 3 << 20] and words[:, 1].tolist() == [64, 32, 32]
    assert maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 3 << 20}) is first and len(calls) == 3
    second = maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 4 << 20})
    assert len(calls) == 6 and second is not first
    assert second.view(np.uint64).reshape(3, 16)[:, 0].tolist() == [1 << 20, 2 << 20, 4 << 20]
    assert words[2, 0] == 3 << 20, "an argument once made is never written again"


def test_a_broadcast_batch_dim_is_one_entry_in_its_map(monkeypatch):
    """TensorMaps: k and v broadcast over query heads (stride 0) are mapped with that dim of one entry, which the
    kernel reads at coordinate 0; q keeps every entry of it. An input the kernel reads entry by entry (not named
    in ``broadcast``) with such a dim is refused, never mapped short."""
    seen = {}

    def encode(at, code, rank, address, dims, strides, box, element_strides, *flags):
        seen[address] = (list(dims), list(strides))
        return 0

    monkeypatch.setattr(tma, "_encoder", lambda: encode)
    q = _FakeArray((2, 2, 3, 100, 128), (6 * 100 * 256, 3 * 100 * 256, 100 * 256, 256, 2))
    kv = _FakeArray((2, 2, 1, 100, 128), (2 * 100 * 256, 100 * 256, 0, 256, 2))
    arrays = {"q": q, "k": kv, "v": kv}
    strides = {"q": [6 * 100 * 128, 3 * 100 * 128, 100 * 128], "k": [2 * 100 * 128, 100 * 128, 0]}
    strides["v"] = strides["k"]
    maps = tma.TensorMaps(arrays, [2, 2, 3], strides, {"q": 64, "k": 32, "v": 32}, broadcast=("k", "v"))
    maps.encode({"q": 1 << 20, "k": 2 << 20, "v": 3 << 20})
    assert seen[1 << 20] == ([128, 100, 3, 2, 2], [256, 100 * 256, 3 * 100 * 256, 6 * 100 * 256])
    # the group dim: one entry (any valid stride); heads and batch at their own strides
    assert seen[2 << 20] == ([128, 100, 1, 2, 2], [256, 16, 100 * 256, 2 * 100 * 256]) == seen[3 << 20]
    with pytest.raises(ValueError, match="v is broadcast over batch dims"):
        tma.TensorMaps(arrays, [2, 2, 3], strides, {"q": 64, "k": 32, "v": 32}, broadcast=("k",))
