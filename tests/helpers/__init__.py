"""Shared test machinery, defined once: the accuracy rule (``checks``), random problems (``problems``), the
score modifiers' helpers (``modifiers``), GPU-only helpers (``gpu``) and the loader of bench/ scripts
(``bench``). Nothing here imports CuPy at module level: CuPy is optional (``cupyflash._arrays.cupy`` is None
without it), so the CPU tests run with NumPy alone."""
