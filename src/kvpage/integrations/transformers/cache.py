"""``KVPageCache``: a transformers ``Cache`` whose layers store keys and values in a kvpage KV format.

::

    from kvpage.integrations.transformers import KVPageCache

    cache = KVPageCache(model.config, kv_cache_dtype="int4")
    out = model.generate(**inputs, max_new_tokens=64, cache=cache)   # past_key_values=cache before transformers 5.2x

One :class:`~kvpage.spec.CacheSpec` (:meth:`CacheSpec.build <kvpage.spec.CacheSpec.build>` from the model
config's layer count, KV heads, head size and sliding-window layers) decides every layer's tensors, dtype and
bytes, as in kvpage's engine; each model layer gets a :class:`~kvpage.integrations.transformers.layer.KVPageLayer`
(token-wise formats) or :class:`~kvpage.integrations.transformers.sealed.SealedKVPageLayer` (block-wise
``int4``/``int2``) over its own paged pool. transformers' attention receives dequantized keys and values: the
cache saves memory per token, not attention time.

Left padding: each batch row's left pads are known to the cache from its first update (the ``position_ids``
transformers' ``generate`` passes count a row's positions from its first real token; or
:meth:`KVPageCache.set_padding`). Block-wise formats never store a pad: a row's blocks, quantization scales,
window and 8-bit first block are those of the row run alone, so padding changes no row's numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvpage.errors import KVCacheLayoutError
from kvpage.formats import BlockFormat, FloatFormat, KVFormat, get_format
from kvpage.integrations.transformers.layer import KVPageLayer
from kvpage.integrations.transformers.layout import SLIDING, ModelLayout, check_transformers_version, model_layout
from kvpage.integrations.transformers.sealed import SealedKVPageLayer
from kvpage.scales import StaticScales
from kvpage.spec import CacheSpec


def _model_dtype(dtype: torch.dtype | None, config: Any) -> torch.dtype:
    """``dtype``, else the config's ``dtype`` when it names a float dtype, else float32."""
    if dtype is not None:
        return dtype
    d = getattr(config, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else torch.float32


def _position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The step's ``position_ids`` among what transformers passes ``Cache.update`` (5.2x: ``kwargs=`` the
    attention's keyword arguments; a ``cache_kwargs`` dict in earlier releases), else ``None``."""
    for where in (kwargs, kwargs.get("kwargs"), *args):
        if isinstance(where, dict) and isinstance(where.get("position_ids"), torch.Tensor):
            return where["position_ids"]
    return None


class KVPageCache(Cache):
    """A transformers ``Cache`` storing every layer's keys and values in a kvpage format, in paged blocks.

    Args:
        config: the model's ``PreTrainedConfig`` (its decoder text config is read: layers, KV heads, head size,
            ``layer_types``/``sliding_window``).
        kv_cache_dtype: a kvpage format name or alias (:func:`kvpage.formats.available_formats`: ``auto``,
            ``float32``, ``bfloat16``, ``float16``, ``int8``, ``fp8``, ``int8_rotated``, ``fp8_per_token_head``,
            ``int8_static``, ``fp8_static``, ``int4``, ``int3``, ``int2``). ``auto`` is the model's dtype (taken from the
            first keys the cache sees).
        max_cache_tokens: the most tokens one layer's pool holds, over all batch rows (beams included), in
            whole blocks; the pool is allocated at once on the first update, plus one block per batch row for
            partial blocks. ``None`` (default): each layer's pool grows on demand.
        block_size: tokens per block; default the format's preferred size (16 token-wise, 32 for
            ``int4``/``int3``/``int2``, whose key groups are the block).
        kv_cache_scales: calibrated static scales (a :class:`~kvpage.scales.StaticScales` or a scales file from
            ``kvpage calibrate`` / :func:`~kvpage.integrations.transformers.calibrate_static_scales`); required by
            ``int8_static``/``fp8_static``, ignored by the other formats.
        residual_tokens: the full-precision window of ``int4``/``int3``/``int2`` in tokens (``None``: the format's
            default, 0 for ``int4`` and ``int3``, 32 for ``int2``); ignored by token-wise formats.
        dtype: the model's compute dtype, for ``auto`` before the first update (default: the config's, else
            float32).

    Attributes:
        spec: the cache layout (:class:`~kvpage.spec.CacheSpec`), the source of every layer's tensors and bytes.
        layout: what was read from the config (:class:`~kvpage.integrations.transformers.layout.ModelLayout`).
        layers: one :class:`KVPageLayer` / :class:`SealedKVPageLayer` per model layer.

    Raises:
        UnknownKVFormatError: an unknown ``kv_cache_dtype`` (the message lists the valid names).
        UnsupportedModelError: a config whose attention layout the cache cannot hold (MLA, linear or chunked
            attention, shared-KV layers, per-layer head shapes, encoder-decoder); the message names it.
        StaticScalesError: a static-scale format without ``kv_cache_scales``, or scales that do not fit.
        FileNotFoundError: ``kv_cache_scales`` names no file.
        UnsupportedTransformersError: the installed transformers is outside the supported range.
        ValueError: a non-positive ``max_cache_tokens``/``block_size``, a negative ``residual_tokens``.
    """

    def __init__(
        self,
        config: Any,
        kv_cache_dtype: str | KVFormat = "auto",
        *,
        max_cache_tokens: int | None = None,
        block_size: int | None = None,
        kv_cache_scales: StaticScales | str | Path | None = None,
        residual_tokens: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_transformers_version()
        self.layout: ModelLayout = model_layout(config)
        self._auto = isinstance(kv_cache_dtype, str) and kv_cache_dtype.strip().lower() == "auto"
        model_dtype = _model_dtype(dtype, config)
        fmt = kv_cache_dtype if isinstance(kv_cache_dtype, KVFormat) else get_format(kv_cache_dtype, model_dtype)
        if max_cache_tokens is not None and max_cache_tokens <= 0:
            raise ValueError(f"max_cache_tokens must be positive (or None to grow on demand), got {max_cache_tokens}")
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.max_cache_tokens = max_cache_tokens
        self.residual_tokens = residual_tokens
        self._block_size = block_size or fmt.preferred_block_size
        self._scales = kv_cache_scales
        self.spec = self._build_spec(fmt, model_dtype)
        self._padding: list[int] | None = None
        super().__init__(layers=self._make_layers(), offloading=False)

    # -- construction --------------------------------------------------------------------------
    def _build_spec(self, fmt: KVFormat, model_dtype: torch.dtype) -> CacheSpec:
        lay = self.layout
        return CacheSpec.build(
            num_layers=lay.num_layers, num_kv_heads=lay.kv_heads, head_dim=lay.head_dim, model_dtype=model_dtype,
            block_size=self._block_size, kv_cache_dtype=fmt, model_name=f"transformers:{lay.model_type}",
            static_scales=self._scales, layer_windows=lay.layer_windows if lay.sliding_window else None,
        )

    def _make_layers(self) -> list[KVPageLayer]:
        bs = self.spec.block_size
        limit = None if self.max_cache_tokens is None else -(-self.max_cache_tokens // bs)
        layers: list[KVPageLayer] = []
        for i, kind in enumerate(self.layout.layer_types):
            spec = self.spec.layer(i)
            window = self.layout.sliding_window if kind == SLIDING else None
            if isinstance(spec.format, BlockFormat):
                layers.append(SealedKVPageLayer(spec, i, sliding_window=window, max_blocks=limit,
                                                residual_tokens=self.residual_tokens))
            else:
                layers.append(KVPageLayer(spec, i, sliding_window=window, max_blocks=limit))
        return layers

    @property
    def kv_format(self) -> KVFormat:
        """The layers' format (``auto`` resolved)."""
        return self.spec.main.layer.format

    def __repr__(self) -> str:
        return (f"KVPageCache({self.kv_format.name}, {self.layout.model_type}, layers={len(self.layers)}, "
                f"block_size={self.spec.block_size}, tokens={self.get_seq_length()})")

    # -- transformers entry points -----------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer_idx``'s new keys/values (``[batch, kv_heads, n, head_dim]``) and return its context.

        With ``kv_cache_dtype="auto"``, the first update of an empty cache resolves it to ``key_states.dtype``
        (rebuilding the spec and the layers when the guess from the config differed). On the first update of
        a layer it takes each row's left pads (:meth:`set_padding`'s, else read from the step's
        ``position_ids``). See :meth:`KVPageLayer.update` for the result and the errors; also
        ``KVCacheLayoutError`` when :meth:`set_padding` was given another number of rows.
        """
        if (self._auto and isinstance(self.kv_format, FloatFormat) and key_states.dtype != self.kv_format.dtype
                and not any(layer.is_initialized for layer in self.layers)):
            self.spec = self._build_spec(get_format("auto", key_states.dtype), key_states.dtype)
            self.layers = list(self._make_layers())
        layer = self.layers[layer_idx]
        if layer.num_tokens == 0:
            layer.pads = self._row_pads(key_states.shape[0], key_states.shape[2], args, kwargs)
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        return keys, values

    # -- left padding --------------------------------------------------------------------------------
    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Tell the cache each batch row's left pads, from the 2D attention mask of the coming prompt.

        ``model.generate(..., attention_mask=...)`` needs no call: at the first update the cache reads each row's
        pads from the ``position_ids`` transformers passes (see :meth:`update`). Call this before the first
        forward of a loop that passes the mask but no count-based position ids, or whose first chunk is all
        pads for a row. The padding holds for the prompt the cache starts next, until :meth:`reset`.

        Args:
            attention_mask: ``[batch, seq]`` (bool or integer) mask, 0 at each row's leading pads and 1 from
                its first real token on (left padding only).

        Raises:
            ValueError: not a 2D mask of 0/1, or a row with a 0 after a 1 (not left padding); the cache already
                holds tokens (``reset()`` first).
        """
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must be a 2D [batch, seq] tensor, got {shape}")
        mask = attention_mask.detach().to("cpu", torch.long)
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
        if (mask[:, 1:] < mask[:, :-1]).any():
            bad = int((mask[:, 1:] < mask[:, :-1]).any(1).nonzero()[0])
            raise ValueError(f"attention_mask row {bad} has a pad after a token: KVPageCache takes left padding only")
        if self.get_seq_length():
            raise ValueError(f"set_padding on a cache that holds {self.get_seq_length()} tokens; call reset() first")
        self._padding = (mask.shape[1] - mask.sum(1)).tolist()

    def _row_pads(self, rows: int, n: int, args: tuple, kwargs: dict) -> list[int]:
        """Each row's left pads for an update of ``n`` tokens into an empty layer: :meth:`set_padding`'s, else
        read from the step's ``position_ids`` (transformers' ``generate`` counts a row's positions from its first
        real token: a row whose positions end ``0, 1, .., r - 1`` after ``n - r`` others has ``n - r`` pads);
        zeros where neither says.

        Raises:
            KVCacheLayoutError: :meth:`set_padding` was given another number of rows than the update has.
        """
        if self._padding is not None:
            if len(self._padding) != rows:
                raise KVCacheLayoutError(
                    f"set_padding was given an attention_mask of {len(self._padding)} rows, the update has {rows}"
                )
            return list(self._padding)
        pos = _position_ids(args, kwargs)
        if pos is None or pos.dim() != 2 or pos.shape[1] != n or pos.shape[0] not in (1, rows):
            return [0] * rows
        pos = pos.detach().to("cpu").expand(rows, n)
        pads = []
        for row in pos.tolist():
            real = row[-1] + 1
            pad = n - real
            ok = 0 <= pad < n and row[pad:] == list(range(real))
            pads.append(pad if ok else 0)
        return pads

    def reset(self) -> None:
        """Forget every token (and :meth:`set_padding`'s pads); the layers keep their pools."""
        self._padding = None
        for layer in self.layers:
            layer.reset()

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs: Any) -> None:
        """Keep, until the next :meth:`crop`, what rolling back the coming steps needs (every layer's
        ``activate_past_recording``; transformers' assisted generation calls it, and so may a user who will crop).

        ``recurrent_states_to_keep`` (passed by transformers 5.25+) and any further keyword are for recurrent
        (linear-attention) layers, which keep a state per step; kvpage's layers hold attention KV only, so they
        are accepted and unused."""
        for layer in self.layers:
            layer.activate_past_recording()

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The most tokens layer ``layer_idx`` serves a query: its sliding window, or -1 (no limit)."""
        return self.layers[layer_idx].get_max_length()

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of KV data the cache holds for its tokens, every layer (see :meth:`KVPageLayer.kv_bytes` and
        :meth:`SealedKVPageLayer.kv_bytes`: codes, scales, zero points, full-precision tail/window, 8-bit first
        block; a block shared by beams counts once)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache has allocated (whole pools, free blocks included)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def code_bytes(self) -> int:
        """Bytes of the tokens' codes, scales and zero points in the pools, at the format's rate: every token
        of a token-wise format, the sealed blocks' tokens of ``int4``/``int2`` (shared blocks once). What
        each further token costs; :meth:`side_bytes` is the rest of :meth:`kv_bytes`."""
        return sum(layer.code_bytes() for layer in self.layers)

    def side_bytes(self) -> int:
        """Bytes the cache holds beside its tokens' codes (``kv_bytes() - code_bytes()``): the unfilled end of
        partial blocks and, for ``int4``/``int2``, the open block in 16 bits (and its reserved pool block),
        the window's 16-bit copies and the first block's 8-bit copy. Fixed costs of a sequence, not of each
        token: on a short sequence they can outweigh the codes."""
        return self.kv_bytes() - self.code_bytes()

    def bits_per_value(self) -> float:
        """Bits per cached key or value element of the codes, scales and zero points: ``8 * code_bytes()`` over
        the values they hold (``2 * kv_heads * head_dim`` per token slot of :meth:`code_bytes`), the spec's
        per-value rate, which is what each further token costs (int4 ~4.4, float16 16). The fixed side costs of
        a short sequence are not in it: :meth:`side_bytes` (see :meth:`memory` for both).

        Raises:
            ValueError: the cache holds no token.
        """
        if not any(layer.num_tokens for layer in self.layers):
            raise ValueError("the cache holds no token")
        lay = self.layout
        values = sum(2 * layer.code_tokens() * lay.kv_heads * lay.head_dim for layer in self.layers)
        if not values:  # int4/int2 before their first block sealed: no codes yet, the rate is the spec's
            spec_layers = [self.spec.layer(i) for i in range(len(self.layers))]
            return sum(ls.bits_per_value for ls in spec_layers) / len(spec_layers)
        return 8 * self.code_bytes() / values

    def memory(self) -> KVMemory:
        """What the cache holds now, the per-value rate and the fixed side costs apart (``str()`` of it is one line).

        Raises:
            ValueError: the cache holds no token.
        """
        rows = max((layer.table.num_rows for layer in self.layers if layer.table is not None), default=0)
        return KVMemory(kv_format=self.kv_format.name, tokens=self.get_seq_length(), rows=rows,
                        bits_per_value=self.bits_per_value(), code_bytes=self.code_bytes(),
                        side_bytes=self.side_bytes())


@dataclass(frozen=True)
class KVMemory:
    """A :class:`KVPageCache`'s memory, its per-token rate and its fixed side costs apart (:meth:`KVPageCache.memory`).

    Attributes:
        kv_format: the format's name.
        tokens: tokens per batch row (``get_seq_length()``).
        rows: batch rows (beams included).
        bits_per_value: codes, scales and zero points per cached K or V value (the format's rate).
        code_bytes: bytes of the tokens' codes at that rate, every layer.
        side_bytes: bytes beside them: partial blocks' unfilled slots, ``int4``/``int2``'s 16-bit open block and
            window, 8-bit first block.
    """

    kv_format: str
    tokens: int
    rows: int
    bits_per_value: float
    code_bytes: int
    side_bytes: int

    @property
    def kv_bytes(self) -> int:
        """All bytes held: ``code_bytes + side_bytes``."""
        return self.code_bytes + self.side_bytes

    def __str__(self) -> str:
        return (f"{self.kv_format}: {self.tokens:,} tokens x {self.rows} row(s) hold {self.kv_bytes:,} bytes = "
                f"{self.code_bytes:,} of codes and scales ({self.bits_per_value:.3g} bits/value) + "
                f"{self.side_bytes:,} of fixed side costs (partial blocks; int4/int2: 16-bit open block and "
                f"window, 8-bit first block)")
