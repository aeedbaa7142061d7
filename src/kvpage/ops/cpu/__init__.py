"""kvpage's CPU kernels: a C++ extension (``paged_attention.cpp`` and others), built by :mod:`.build` at install
(``kvpage build-kernels``) or on first use.

Used through the ``cpu`` attention backend (:mod:`kvpage.ops.backends.cpu`), the decoder's fused ops
(:mod:`kvpage.ops.fused`) and the model's projections (:mod:`kvpage.model.linear`: ``amx_linear.cpp``;
:mod:`kvpage.model.quantized_linear`: ``gguf_matmul.cpp``), never directly by the engine.
"""
