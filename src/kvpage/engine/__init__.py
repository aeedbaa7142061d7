"""The engine: configuration, assembly, scheduling, the model runner and the ``LLM`` API.

``config`` validates every setting once, ``build`` assembles the parts top-down; ``scheduler`` batches
over ``kv_cache`` (the device manager with the tier connector around it); ``model_runner`` runs a forward
pass with one attention ``backends`` entry per layer group; ``engine`` is the step loop and ``llm`` the
public API. May import every lower layer (``spec``, ``formats``, ``model``, ``ops``, ``cache``), never
``kvpage.server``.
"""
