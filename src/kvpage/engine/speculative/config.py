"""``SpeculativeConfig``: how the engine speculates, written as vLLM users write ``speculative_config``.

``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})``, or the same JSON through
``--speculative-config`` on ``kvpage generate`` / ``kvpage serve``. Three methods:

* ``"ngram"``: prompt lookup (Saxena 2023; vLLM's ``ngram``): propose what followed the latest earlier
  occurrence of the request's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens. No draft KV.
* ``"draft_model"``: a smaller model of the same tokenizer (``"model": PATH``, any checkpoint the loader
  reads) proposes; its layers form the spec's ``draft`` layer group, in ``draft_kv_cache_dtype``, sharing
  the request's block table and paid from the same KV budget.
* ``"layer_skip"``: a self-draft made of the target's first ``num_layers`` decoder layers, its final norm
  and LM head (early exit; LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2023). Weights
  and the KV of those layers are the target's own: no extra memory.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpage.config_json import config_fields

if TYPE_CHECKING:
    from kvpage.model.loader import LoadedModel

#: The methods :class:`SpeculativeConfig` accepts.
METHODS = ("ngram", "draft_model", "layer_skip")


def _int_field(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings; every field is checked when it is built.

    Attributes:
        method: ``"ngram"``, ``"draft_model"`` or ``"layer_skip"`` (see the module docstring).
        num_speculative_tokens: draft tokens proposed per request per step (``k``, >= 1); the
            scheduler reserves that many lookahead slots for each speculating request.
        prompt_lookup_min: ``ngram``: shortest suffix matched (>= 1; default 2).
        prompt_lookup_max: ``ngram``: longest suffix matched (>= ``prompt_lookup_min``; default 5).
        model: ``draft_model``: path of the draft checkpoint (a ``.gguf`` file or a Hugging Face folder),
            or (Python API) a loaded :class:`~kvpage.model.loader.LoadedModel`, used as is; it must share
            the target's vocabulary.
        draft_kv_cache_dtype: ``draft_model``: the draft layers' KV format (default: the main one);
            a token-wise format (quantize-on-seal formats such as ``int4`` are refused for draft layers).
        num_layers: ``layer_skip``: decoder layers of the self-draft (>= 1, fewer than the target's);
            default a quarter of the target's layers, at least 1.
        disable_by_batch_size: no drafts in a step where at least this many requests run (vLLM's
            name): a large batch already amortizes the weight reads that speculation saves, and its
            verification rows make the pass compute-bound. ``None`` = always speculate.

    Raises:
        ValueError: an unknown method or key, a field of the wrong type or range, or a field that the
            method does not use (the message names ``speculative_config.<field>``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | LoadedModel | None = None
    draft_kv_cache_dtype: str | None = None
    num_layers: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _int_field("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        if self.disable_by_batch_size is not None:
            _int_field("disable_by_batch_size", self.disable_by_batch_size, minimum=1)
        own = {"ngram": {"prompt_lookup_min", "prompt_lookup_max"},
               "draft_model": {"model", "draft_kv_cache_dtype"},
               "layer_skip": {"num_layers"}}[self.method]
        for name in ("prompt_lookup_min", "prompt_lookup_max", "model", "draft_kv_cache_dtype", "num_layers"):
            if getattr(self, name) is not None and name not in own:
                raise ValueError(f"speculative_config.{name} is not used by method {self.method!r} "
                                 f"(its settings: {', '.join(sorted(own))})")
        if self.method == "ngram":
            lo = 2 if self.prompt_lookup_min is None else _int_field("prompt_lookup_min", self.prompt_lookup_min,
                                                                      minimum=1)
            hi = max(5, lo) if self.prompt_lookup_max is None else _int_field(
                "prompt_lookup_max", self.prompt_lookup_max, minimum=1)
            if self.prompt_lookup_min is None and hi < lo:
                lo = hi
            if hi < lo:
                raise ValueError(f"speculative_config.prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "draft_model":
            loaded = all(hasattr(self.model, a) for a in ("model", "config", "tokenizer"))
            if not loaded and (not isinstance(self.model, (str, Path)) or not str(self.model).strip()):
                raise ValueError("speculative_config.model must be the path of the draft model for method "
                                 f"'draft_model', got {self.model!r}")
            if not loaded:
                object.__setattr__(self, "model", str(self.model))
            if self.draft_kv_cache_dtype is not None and not isinstance(self.draft_kv_cache_dtype, str):
                raise ValueError(f"speculative_config.draft_kv_cache_dtype must be a KV format name, "
                                 f"got {self.draft_kv_cache_dtype!r}")
        if self.method == "layer_skip" and self.num_layers is not None:
            _int_field("num_layers", self.num_layers, minimum=1)

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """A config from itself, a dict of its fields, or that dict as a JSON string (``--speculative-config``).

        Raises:
            ValueError: bad JSON, not an object, an unknown key or a bad field (named).
        """
        if isinstance(value, cls):
            return value
        value = config_fields(value, "speculative_config", (f.name for f in fields(cls)))
        for need in ("method", "num_speculative_tokens"):
            if need not in value:
                raise ValueError(f"speculative_config.{need} is required")
        return cls(**value)

    def draft_layers(self, num_target_layers: int) -> int:
        """``layer_skip``: the self-draft's decoder layers for a target of ``num_target_layers``.

        Raises:
            ValueError: ``num_layers`` not below the target's layer count.
        """
        n = max(1, num_target_layers // 4) if self.num_layers is None else self.num_layers
        if n >= num_target_layers:
            raise ValueError(f"speculative_config.num_layers ({n}) must be below the target's {num_target_layers} "
                             f"layers (the self-draft is the target's first num_layers layers)")
        return n
