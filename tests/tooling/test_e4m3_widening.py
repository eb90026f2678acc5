"""cuda_src/e4m3.cuh widens e4m3 codes to float16 by their bits on sm_80 (sm_89 and newer convert by instruction, and
an H200 runs that one, so no GPU test reaches the bits): the same operations in NumPy, on every pair of codes a
uint32 can hold, give every code's e4m3 value exactly, -0 and subnormals included, and NaN for the NaN codes."""

import ml_dtypes
import numpy as np

from cupyflash._cuda.source import source_dir


def widen_pair_by_bits(two_codes: np.ndarray) -> np.ndarray:
    """e4m3.cuh's sm_80 branch of widen_e4m3x2 on uint32 words whose low 16 bits hold two codes: (n, 2) float16."""
    c0, c1 = two_codes & 0xFF, (two_codes >> 8) & 0xFF
    at8 = (c0 << 8) | (c1 << 24)  # __byte_perm(two_codes, 0, 0x1404): each code in bits 8..15 of its half
    bits = (at8 & 0x80008000) | ((at8 >> 1) & 0x3F803F80)
    halves = np.stack([bits & 0xFFFF, bits >> 16], axis=-1).astype(np.uint16).view(np.float16)
    scaled = halves * np.float16(256) + np.float16(-0.0)  # fma.rn.f16x2 by 2^8 (exact), plus -0
    nan = np.stack([(at8 & 0x7F00) == 0x7F00, (at8 & 0x7F000000) == 0x7F000000], axis=-1)
    return np.where(nan, np.float16(np.nan), scaled)


def test_every_code_widens_exactly():
    codes = np.arange(256, dtype=np.uint32)
    words = codes | (codes[::-1] << 8)  # every code in the low and in the high position
    got = widen_pair_by_bits(words)
    for position, which in ((0, codes), (1, codes[::-1])):
        want = which.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
        np.testing.assert_array_equal(np.isnan(got[:, position]), np.isnan(want))
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(got[finite, position], want[finite])
        np.testing.assert_array_equal(np.signbit(got[finite, position]), np.signbit(want[finite]))  # -0 stays -0


def test_the_emulation_follows_the_header():
    """The constants emulated above are the header's (a change there must change this test too)."""
    text = (source_dir() / "e4m3.cuh").read_text()
    for constant in ("0x1404u", "0x80008000u", "0x3F803F80u", "0x5C005C00u", "0x7F007F00u"):
        assert constant in text, f"e4m3.cuh no longer uses {constant}"
