"""kvpage: a paged, quantized KV-cache manager and a small LLM engine built on it."""
from __future__ import annotations

__version__ = "0.1.0"

from kvpage.errors import (  # noqa: E402
    KVCacheLayoutError,
    KVPageError,
    OutOfBlocksError,
    PromptTooLongError,
    UnknownKVFormatError,
)

__all__ = [
    "LLM",
    "SamplingParams",
    "CacheSpec",
    "KVCacheLayoutError",
    "KVPageError",
    "OutOfBlocksError",
    "PromptTooLongError",
    "UnknownKVFormatError",
    "__version__",
]


def __getattr__(name: str):  # lazy: importing kvpage must not import transformers
    if name == "LLM":
        from kvpage.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpage.engine.sampling import SamplingParams

        return SamplingParams
    if name == "CacheSpec":
        from kvpage.spec import CacheSpec

        return CacheSpec
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
