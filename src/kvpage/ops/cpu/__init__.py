"""kvpage's CPU kernels: a C++ extension (``paged_attention.cpp`` and others), built by :mod:`.build` at install
(``kvpage build-kernels``) or on first use.

Used through the ``cpu`` attention backend (:mod:`kvpage.ops.backends.cpu`), never directly by the engine.
"""
