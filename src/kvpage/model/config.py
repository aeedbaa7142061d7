"""The model facts kvpage needs, read once from a transformers config.

:class:`ModelConfig` is the single place the engine, the cache spec and the
model read shapes from (layers, heads, head_dim, vocab). It is built from a
transformers ``PretrainedConfig`` (from a GGUF file or a ``config.json``) and
keeps that config for what it does not flatten: RoPE initialisation, which is
delegated to transformers' ``ROPE_INIT_FUNCTIONS`` so every scaling variant
matches the library exactly, and the family-specific extras (sliding windows,
soft-caps, biases...) that :mod:`kvpage.model.families` reads from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvpage.model import families

#: ``model_type`` values whose checkpoints kvpage's model computes exactly (:data:`kvpage.model.families.FAMILIES`).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(families.FAMILIES)

#: RoPE types whose frequencies do not depend on the sequence length, so a
#: per-position table is exact. ("dynamic" and "longrope" rescale with the
#: current length, which differs per request in a varlen batch.)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only LM (any family of :mod:`kvpage.model.families`), as the runtime needs it.

    Invariants (checked in :meth:`__post_init__`): ``num_heads`` is a multiple of
    ``num_kv_heads`` (GQA group size ``num_heads // num_kv_heads``); all sizes
    are positive.

    Attributes:
        vocab_size: rows of the token embedding (and of the LM head).
        hidden_size: residual stream width.
        intermediate_size: SwiGLU inner width (gate and up projections).
        num_layers: decoder layers (no draft/MTP layers in this family).
        num_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (GQA when < ``num_heads``).
        head_dim: width of one head; may differ from ``hidden_size // num_heads``.
        rms_norm_eps: epsilon inside RMSNorm's ``rsqrt``.
        rope_theta: RoPE base wavelength (Gemma 3: of the global, ``full_attention`` layers).
        rope_scaling: transformers' ``rope_parameters`` dict (with ``rope_type``)
            when the type is not ``"default"``, else ``None`` (Gemma 3: the global layers' entry).
        max_position_embeddings: context length the checkpoint was trained for;
            the model's RoPE table covers positions ``[0, max_position_embeddings)``.
        tie_word_embeddings: the LM head reuses the token-embedding matrix.
        bos_token_id: beginning-of-sequence id, or ``None``.
        eos_token_ids: ids that end generation (may be empty).
        torch_dtype: dtype of the weights as loaded from the checkpoint
            (``float32`` for dequantized GGUF tensors).
        hf_config: the transformers config this was built from (not compared,
            not hashed); used for RoPE initialisation.
        kv_has_value: ``False`` for a key-only cache (MLA's latent: ``num_kv_heads`` 1 and ``head_dim`` the
            latent plus decoupled-RoPE width; its keys serve as values).

    The family is :attr:`model_type` (``hf_config.model_type``, ``"llama"`` without one); its
    extras (sliding windows, soft-caps, biases...) are read from ``hf_config`` by
    :func:`kvpage.model.families.resolve`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype = torch.float32
    hf_config: Any = field(default=None, compare=False, hash=False, repr=False)
    kv_has_value: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def model_type(self) -> str:
        """The family: transformers' ``model_type`` of :attr:`hf_config`, ``"llama"`` for a hand-built config."""
        return "llama" if self.hf_config is None else str(getattr(self.hf_config, "model_type", None) or "llama")

    @property
    def rope_type(self) -> str:
        """The RoPE variant: ``"default"`` or ``rope_scaling["rope_type"]``."""
        return "default" if self.rope_scaling is None else str(self.rope_scaling.get("rope_type", "default"))

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf_config: Any, torch_dtype: torch.dtype | None = None) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` of a supported family (:data:`SUPPORTED_MODEL_TYPES`).

        Reads both the transformers-5 layout (``rope_parameters`` holding
        ``rope_theta``/``rope_type``, possibly nested by layer type as Gemma 3's)
        and the older one (``rope_theta`` + ``rope_scaling`` attributes).

        Args:
            hf_config: e.g. ``LlamaConfig`` or ``Qwen2Config`` from ``AutoConfig.from_pretrained``.
            torch_dtype: overrides the config's ``dtype``/``torch_dtype`` (the
                GGUF loader passes ``float32``: it dequantizes to float32).

        Returns:
            The flattened config; ``hf_config`` is kept on it. A family with its own
            ``config_builder`` (:class:`kvpage.model.families.Family`) builds it instead.

        Raises:
            ValueError: unsupported ``model_type`` (named), an activation the family
                does not implement (Llama-likes: SiLU; Gemma: ``gelu_pytorch_tanh``),
                attention biases where the family has none, MLP biases, bidirectional
                attention, partial rotary embeddings, or a RoPE type whose frequencies
                depend on sequence length (every ``rope_parameters`` entry is checked).
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in families.FAMILIES:
            raise ValueError(
                f"unsupported architecture {model_type!r} "
                f"(architectures={getattr(hf_config, 'architectures', None)}); "
                f"kvpage's model supports model_type in {tuple(families.FAMILIES)}"
            )
        family = families.FAMILIES[model_type]
        if family.config_builder is not None:
            built: ModelConfig = families.load_attr(family.config_builder)(hf_config, torch_dtype)
            return built
        families.resolve(model_type, hf_config, int(hf_config.num_hidden_layers))  # raises on what is unsupported

        fields = common_hf_fields(hf_config, torch_dtype)   # raises on an unsupported RoPE
        num_heads = int(fields["num_heads"])
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
        return cls(**fields, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def to_hf(self) -> Any:
        """The transformers config: the stored ``hf_config``, or a ``LlamaConfig`` rebuilt from the fields.

        Returns:
            A ``transformers.PretrainedConfig`` describing the same architecture
            (used for RoPE initialisation and to build reference models in tests).
        """
        if self.hf_config is not None:
            return self.hf_config
        from transformers import LlamaConfig

        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope_parameters,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) or None,
        )


def common_hf_fields(hf_config: Any, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The family-independent :class:`ModelConfig` fields of a transformers config, validated.

    Shared by :meth:`ModelConfig.from_hf` and the families' own ``config_builder`` functions
    (:func:`kvpage.model.deepseek.mla_model_config`); each adds what differs (``num_kv_heads``,
    ``head_dim``, ``kv_has_value``). RoPE is read from the transformers-5 layout (``rope_parameters``
    holding ``rope_theta``/``rope_type``, possibly nested by layer type as Gemma 3's: the
    ``full_attention`` entry) or the older one (``rope_theta`` + ``rope_scaling`` attributes).

    Args:
        hf_config: a transformers ``PretrainedConfig`` (or an object with the same attributes).
        torch_dtype: overrides the config's ``dtype`` (``torch_dtype`` on configs without one: reading it on
            transformers 5 only logs a deprecation); the default is float32 when the config names none.

    Returns:
        ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_layers``, ``num_heads`` (query heads),
        ``rms_norm_eps``, ``rope_theta``, ``rope_scaling`` (``None`` for the default type, else the RoPE
        dict with ``rope_type``), ``max_position_embeddings``, ``tie_word_embeddings``, ``bos_token_id``,
        ``eos_token_ids`` (a tuple of ints), ``torch_dtype`` (a ``torch.dtype``) and ``hf_config`` itself,
        as keyword arguments of :class:`ModelConfig`.

    Raises:
        ValueError: no ``rope_theta``, a RoPE type outside :data:`SUPPORTED_ROPE_TYPES`, or a partial rotary
            factor other than 1 (every ``rope_parameters`` entry is checked).
    """
    nested = families.nested_rope_parameters(hf_config)
    rope = dict((nested or {}).get(families.FULL_ATTENTION) or {}) if nested is not None else dict(
        getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if not rope and legacy_scaling:
        rope = dict(legacy_scaling)
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither in rope_parameters nor as an attribute)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    for params in [rope, *(nested or {}).values()]:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE type {kind!r}; supported: {SUPPORTED_ROPE_TYPES} "
                "(length-dependent variants cannot use one table for a varlen batch)"
            )
        if float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
                 or 1.0) != 1.0:
            raise ValueError("unsupported partial_rotary_factor != 1.0")

    if torch_dtype is None:
        # transformers 5 names it ``dtype`` (reading ``torch_dtype`` there only logs a deprecation)
        attr = "dtype" if hasattr(hf_config, "dtype") else "torch_dtype"
        torch_dtype = getattr(hf_config, attr, None) or torch.float32
        if isinstance(torch_dtype, str):
            torch_dtype = getattr(torch, torch_dtype)
    eos, bos = getattr(hf_config, "eos_token_id", None), getattr(hf_config, "bos_token_id", None)
    return {
        "vocab_size": int(hf_config.vocab_size),
        "hidden_size": int(hf_config.hidden_size),
        "intermediate_size": int(hf_config.intermediate_size),
        "num_layers": int(hf_config.num_hidden_layers),
        "num_heads": int(hf_config.num_attention_heads),
        "rms_norm_eps": float(hf_config.rms_norm_eps),
        "rope_theta": float(theta),
        "rope_scaling": None if rope_type == "default" else {**rope, "rope_type": rope_type},
        "max_position_embeddings": int(hf_config.max_position_embeddings),
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos),
        "torch_dtype": torch_dtype,
        "hf_config": hf_config,
    }
