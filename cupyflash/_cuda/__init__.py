"""The GPU back end: our CUDA kernels in ``cuda_src/``, compiled at run time by NVRTC through CuPy.

Modules, from the bottom up: ``source`` (the kernel sources, headers inlined), ``tiles`` (the one tile
table), ``tile_policy`` (which variant serves a call), ``variants`` (a variant's compiled form),
``compile`` (the per-device module cache), ``plans`` (the one cache of launch plans and call entries),
``ptxas_report`` (the offline compile audit), ``params`` (arrays -> the kernels' parameter struct),
``f32_pieces`` and ``tma`` (float32 inputs as float16 pieces; TMA tensor maps), ``launch`` (plans, call
entries, streams, chained passes), ``fused_backward`` (the Hopper fused backward's plan), ``ring_states`` (ring
attention's running results, merged in place), ``fp8`` (the FP8 forward), the ``decode*`` modules
(attention_with_kvcache) and ``dense`` (the dense entry points the public API calls). Nothing here touches a GPU
before a CuPy array reaches ``dense``, ``fp8`` or ``decode``.
"""
