"""The KV cache below the engine: the scheduler's façade and its bookkeeping, the step plan, the tensors, the tiers.

Scheduler side (tensor-free): ``kv_cache`` (:class:`~kvpage.cache.kv_cache.KVCache`, the one façade), its
bookkeeping (``prefix_cache``, ``prefix_index``, ``hashing``, ``idpool``, ``groups`` -- one manager per group
kind --, ``tail`` bookkeeping), ``step_plan`` (what the worker executes, as plain data) and ``capacity`` (the
sizes a budget buys). Worker side: ``controller`` allocates and copies the tensors a
:class:`~kvpage.spec.CacheSpec` describes, ``tail.pool`` holds the tail tensors of block-wise formats. ``tiers``
is the connector to host memory, disk and Redis, in two halves. Modules here import ``kvpage.spec``,
``kvpage.formats``, ``kvpage.ops`` and ``kvpage.errors``, never ``kvpage.engine`` or above.
"""
