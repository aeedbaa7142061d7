"""The tiers below the device: host blocks, disk and Redis stores, swap preemption.

``connector`` is the scheduler-side interface (vLLM's v1 KV-connector verbs) and kvpage's implementation;
``offload`` the mechanics it drives (lookups, loads, write policies, swap), ``policy`` their knobs,
``types`` the small shared types; ``host_pool`` and ``transfer`` the host-block and copy bookkeeping;
``host`` the tensor side (:class:`~kvpage.cache.tiers.host.HostTier`) and the factory; ``stores`` the block
stores. Modules here may import ``kvpage.spec``, ``kvpage.errors``, ``kvpage.formats`` and
``kvpage.cache.controller``, never the cache manager or the engine. This ``__init__`` imports nothing.
"""
