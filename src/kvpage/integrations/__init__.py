"""kvpage's KV formats inside other libraries.

* :mod:`kvpage.integrations.transformers` -- :class:`~kvpage.integrations.transformers.KVPageCache`, a
  Hugging Face transformers ``Cache`` that stores each layer's keys and values in a kvpage format (``int8``,
  ``fp8``, ``int4``, ``int2``, the static-scale formats, ...) in paged blocks, for ``model.generate``.

Importing this package imports nothing; each integration imports its own library (and only kvpage's
formats, spec and ops, never the engine or the server) when it is imported itself.
"""
from __future__ import annotations
