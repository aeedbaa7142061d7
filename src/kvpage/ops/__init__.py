"""Tensor ops over the paged KV cache: the attention ops that write (quantize) and read (dequantize) its blocks.

:mod:`~kvpage.ops.attention` serves token-wise formats, :mod:`~kvpage.ops.sealed_attention`
block-wise ones with the step's :mod:`~kvpage.ops.seal_plan`; :mod:`~kvpage.ops.causal` is
their shared per-request SDPA. Imports :mod:`kvpage.spec`, :mod:`kvpage.formats` and
:mod:`kvpage.errors` only, never :mod:`kvpage.cache` or the engine.
"""
