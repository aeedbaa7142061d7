"""The KV cache below the engine: tensors, block bookkeeping, per-group managers and the tiers.

``controller`` allocates and copies the tensors a :class:`~kvpage.spec.CacheSpec` describes; ``tail``
holds the side pool of block-wise formats; everything else is tensor-free bookkeeping (``prefix_cache``,
``manager``, ``groups``, ``hashing``, ``requests``). ``tiers`` is the connector to host memory, disk and
Redis. Modules here import ``kvpage.spec``, ``kvpage.formats``, ``kvpage.ops`` and ``kvpage.errors``,
never ``kvpage.engine`` or ``kvpage.server``.
"""
