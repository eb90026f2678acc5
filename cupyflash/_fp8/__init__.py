"""The FP8 forward, in the four rooms every feature has: ``api`` (its checks and the hand-off to a back end),
``tensor`` (``FP8Tensor`` and ``quantize_fp8``), ``cpu`` (the NumPy path, the naive implementation it is checked
against) and ``hadamard`` (``hadamard_rotate``, which spreads outliers before quantizing). The GPU path is
cupyflash/_cuda/fp8.py. The public names are cupyflash's own; this package imports nothing itself.
"""
