"""The engine: requests, sampling, the model runner and the ``LLM`` API."""
