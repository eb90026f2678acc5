"""Attention against a key/value cache, for decoding, in the four rooms every feature has: ``api``
(``attention_with_kvcache``), ``checks`` (its arguments' checks and the resolved call), ``cpu`` (the NumPy path)
and ``reference`` (the float64 reference, with rotary embeddings). The GPU path is cupyflash/_cuda/decode*.py.
The public names are cupyflash's own; this package imports nothing itself.
"""
