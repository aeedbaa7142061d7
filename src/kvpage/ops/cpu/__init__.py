"""kvpage's CPU kernels: a C++ extension (``paged_attention.cpp``) compiled on first use (:mod:`.build`).

Used through the ``cpu`` attention backend (:mod:`kvpage.ops.backends.cpu`), never directly by the engine.
"""
