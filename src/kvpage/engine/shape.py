"""A model's KV shape as capacity needs it, with or without the model: :class:`ModelShape`, :class:`Shape`.

``kvpage formats`` and the README table size caches for a shape (the bundled model's, or one read from a
model's config by :func:`model_shape`); the engine passes its :class:`~kvpage.model.config.ModelConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """What capacity needs of a model (a :class:`~kvpage.model.config.ModelConfig` has it)."""

    @property
    def num_layers(self) -> int:
        """Decoder layers."""

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""

    @property
    def head_dim(self) -> int:
        """Channels per head."""

    @property
    def max_position_embeddings(self) -> int:
        """The model's context, in tokens."""

    @property
    def kv_has_value(self) -> bool:
        """``False`` for a key-only (MLA latent) cache."""


@dataclass(frozen=True)
class Shape:
    """A model's KV shape without the model (for ``kvpage formats`` and the README table).

    ``layer_windows``: per layer, its sliding window or ``None`` (:meth:`~kvpage.spec.CacheSpec.build`);
    ``None`` = every layer full attention.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    kv_has_value: bool = True
    layer_windows: tuple[int | None, ...] | None = None


def model_shape(path: str) -> Shape:
    """The KV shape of the model at ``path`` (a Hugging Face folder or ``.gguf`` file), read from its config only:
    layers, KV heads and head_dim as the cache stores them (MLA: one latent head, key-only), each layer's window.

    Raises:
        ModelNotFoundError / ValueError: as :func:`~kvpage.model.loader.load_model` for a missing or unsupported model.
    """
    from kvpage.model.families import layer_windows
    from kvpage.model.loader import read_model_config

    config = read_model_config(path)
    windows = layer_windows(config.model_type, config.hf_config, config.num_layers)
    return Shape(config.num_layers, config.num_kv_heads, config.head_dim, config.max_position_embeddings,
                 config.kv_has_value, None if all(w is None for w in windows) else tuple(windows))


#: The bundled SmolLM2-135M-Instruct (tests check it against the loaded config).
SMOLLM2_SHAPE = Shape(num_layers=30, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
