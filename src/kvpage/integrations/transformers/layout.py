"""What :class:`~kvpage.integrations.transformers.KVPageCache` reads from a transformers model config.

Two things, both checked before any cache exists:

* the installed transformers version against :data:`SUPPORTED_TRANSFORMERS`
  (:func:`check_transformers_version`);
* the attention layout of the model (:func:`model_layout`): decoder layers, KV heads, head size and each
  layer's kind. Layers of kind ``full_attention`` and ``sliding_attention`` (with the config's
  ``sliding_window``) are supported; every other kind (linear attention, chunked attention, shared-KV
  "dummy" layers, ...), multi-latent attention (MLA: keys and values of different sizes), per-layer head
  shapes and encoder-decoder models raise :class:`UnsupportedModelError` naming what was found.

Imports transformers' config helpers only when given a config; nothing from kvpage but :mod:`kvpage.errors`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpage.errors import KVPageError

#: transformers releases this integration supports: the 5.x ``CacheLayerMixin`` layer API
#: (``lazy_initialization``, ``update``, ``get_mask_sizes`` returning ``(kv_length, kv_offset)``, ``crop``,
#: ``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``). Tested on the lowest and
#: on the installed release.
SUPPORTED_TRANSFORMERS = (">=5.0.0", "<6")
MIN_TRANSFORMERS, MAX_TRANSFORMERS_EXCLUSIVE = "5.0.0", "6"

#: Layer kinds (transformers' ``config.layer_types`` values) a KVPageCache can hold.
FULL, SLIDING = "full_attention", "sliding_attention"
SUPPORTED_LAYER_TYPES = (FULL, SLIDING)


class UnsupportedModelError(KVPageError, ValueError):
    """A model config whose attention layout :class:`KVPageCache` cannot hold (the message says what and why)."""


class UnsupportedTransformersError(KVPageError, ImportError):
    """The installed transformers release is outside :data:`SUPPORTED_TRANSFORMERS`."""


def check_transformers_version(version: str | None = None) -> str:
    """Check a transformers version string (default: the installed one) against :data:`SUPPORTED_TRANSFORMERS`.

    Returns:
        The checked version string.

    Raises:
        UnsupportedTransformersError: outside the supported range, or transformers not installed (the
            message gives the range and the pip command).
    """
    from packaging.version import Version

    if version is None:
        try:
            import transformers
        except ImportError as e:
            raise UnsupportedTransformersError(
                f"kvpage.integrations.transformers needs transformers {','.join(SUPPORTED_TRANSFORMERS)}, which is "
                f"not installed: pip install 'transformers{','.join(SUPPORTED_TRANSFORMERS)}'"
            ) from e
        version = str(transformers.__version__)
    v = Version(version)
    if not (Version(MIN_TRANSFORMERS) <= v < Version(MAX_TRANSFORMERS_EXCLUSIVE)):
        raise UnsupportedTransformersError(
            f"kvpage.integrations.transformers supports transformers {','.join(SUPPORTED_TRANSFORMERS)} (its 5.x "
            f"cache layer API); found {version}. Install a supported release: "
            f"pip install 'transformers{','.join(SUPPORTED_TRANSFORMERS)}'"
        )
    return version


@dataclass(frozen=True)
class ModelLayout:
    """The attention layout of a decoder model, as a KV cache sees it.

    Attributes:
        num_layers: decoder layers (each holds one cache layer).
        kv_heads: key/value heads per layer.
        head_dim: channels per head (keys and values alike).
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: the window of the sliding layers in tokens (a query sees itself and the
            ``sliding_window - 1`` tokens before it), ``None`` when there are none.
        model_type: the config's ``model_type`` (for messages and fingerprints).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    model_type: str

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer its sliding window or ``None`` (:meth:`kvpage.spec.CacheSpec.build`'s ``layer_windows``)."""
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]


def _per_layer(config: Any, num_layers: int) -> Sequence[Any]:
    """The per-layer views of a config (transformers' ``per_layer_config``, when this release has it)."""
    views = getattr(config, "per_layer_config", None)
    if views is None:
        return [config] * num_layers
    return list(views)


def _layer_types(config: Any, num_layers: int) -> list[str]:
    """Each layer's kind, as transformers' own ``DynamicCache(config=...)`` dispatches them."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # releases before the helper: layer_types, else inferred from sliding_window
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None and getattr(config, "per_layer_config", None) is not None:
        types, _ = get_layer_types_and_kwargs(config)
        return [str(t) for t in types]
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [str(t) for t in types]
    if getattr(config, "sliding_window", None) is not None:
        return [SLIDING] * num_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * num_layers
    return [FULL] * num_layers


def model_layout(config: Any) -> ModelLayout:
    """Read the attention layout from a transformers ``PreTrainedConfig`` (its decoder text config).

    Raises:
        UnsupportedModelError: an encoder-decoder model; no ``num_hidden_layers``; multi-latent attention
            (``kv_lora_rank``/``qk_head_dim``: keys and values of different sizes); heads or head sizes that
            differ between layers; a layer kind other than ``full_attention``/``sliding_attention`` (the message
            names the kinds found and the layers); sliding layers without a positive ``sliding_window``.
    """
    name = str(getattr(config, "model_type", type(config).__name__))
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"model type {name!r} is an encoder-decoder model; KVPageCache holds the self-attention cache of "
            f"decoder-only models"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise UnsupportedModelError(f"model type {name!r}: its config has no positive num_hidden_layers")
    for attr in ("kv_lora_rank", "qk_head_dim", "qk_rope_head_dim"):
        if getattr(text, attr, None) is not None:
            raise UnsupportedModelError(
                f"model type {name!r} uses multi-latent attention ({attr}={getattr(text, attr)}): its keys and "
                f"values differ in size, which KVPageCache does not hold (kvpage's own engine serves MLA models)"
            )
    views = _per_layer(text, num_layers)
    heads = set()
    dims = set()
    for view in views:
        q_heads = getattr(view, "num_attention_heads", None)
        kv = getattr(view, "num_key_value_heads", None) or q_heads
        hidden = getattr(view, "hidden_size", None)
        dim = getattr(view, "head_dim", None) or (hidden // q_heads if hidden and q_heads else None)
        if not kv or not dim:
            raise UnsupportedModelError(
                f"model type {name!r}: cannot read the KV heads / head size from its config "
                f"(num_key_value_heads={kv}, head_dim={dim})"
            )
        heads.add(int(kv))
        dims.add(int(dim))
    if len(heads) > 1 or len(dims) > 1:
        raise UnsupportedModelError(
            f"model type {name!r}: its layers have different KV heads {sorted(heads)} or head sizes {sorted(dims)}; "
            f"KVPageCache needs one shape for all layers"
        )
    types = _layer_types(text, num_layers)
    if len(types) != num_layers:
        raise UnsupportedModelError(f"model type {name!r}: {len(types)} layer_types for {num_layers} layers")
    bad = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        where = {t: [i for i, u in enumerate(types) if u == t] for t in bad}
        raise UnsupportedModelError(
            f"model type {name!r} has layers of type {', '.join(repr(t) for t in bad)} (layers {where}); "
            f"KVPageCache supports {', '.join(SUPPORTED_LAYER_TYPES)} only"
        )
    window = None
    if SLIDING in types:
        window = getattr(text, "sliding_window", None)
        if not isinstance(window, int) or window <= 0:
            raise UnsupportedModelError(
                f"model type {name!r} has sliding_attention layers but its sliding_window is {window!r}"
            )
    return ModelLayout(num_layers, heads.pop(), dims.pop(), tuple(types), window, name)
