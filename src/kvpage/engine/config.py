"""``EngineConfig``: every engine setting, validated once, in one place, with one error per bad field.

:class:`~kvpage.engine.llm.LLM`, the CLI and the server all build one; the
builder (:mod:`kvpage.engine.build`) assembles the engine from it without
checking anything twice. Names follow vLLM's engine arguments where the
meaning is the same (``kv_cache_dtype``, ``block_size``, ``swap_space``,
``max_num_seqs``, ...).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvpage.cache.hashing import DEFAULT_HASH_ALGO, HASH_ALGOS
from kvpage.cache.kv_events.config import KVEventsConfig
from kvpage.cache.tiers.disagg import KVTransferConfig
from kvpage.cache.tiers.policy import OffloadConfig
from kvpage.cache.tiers.stores import StoreURL, parse_store_url
from kvpage.engine.speculative.config import SpeculativeConfig
from kvpage.errors import UnknownKVFormatError
from kvpage.formats import KVFormat, canonical_format_name, get_format, needs_static_scales
from kvpage.model.quantized_linear import check_weights_dtype
from kvpage.ops.backends import BACKEND_NAMES
from kvpage.scales import StaticScales
from kvpage.spec import CacheSizing, format_group_name, missing_scales_error

#: KV budget when none of ``kv_cache_memory_bytes``, ``kv_cache_memory_fraction``, ``num_blocks`` is given.
DEFAULT_KV_CACHE_BYTES = 512 * 2**20

#: Smallest block of quantize-on-seal formats: their key scale and zero point are per channel per
#: block (the block is the key quantization group), 3 bytes per channel, i.e. ``24 / block_size``
#: extra bits per key value: 3 bits at 8 tokens, 24 (more than a 16-bit cache) at 1.
MIN_SEALED_BLOCK_SIZE = 8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_layer_dtypes(text: str, field_name: str | None = "kv_layer_dtypes") -> dict[int, str]:
    """The per-layer format map of its command-line spelling ``"17,20,24:int4_rotated;27,13:int2_rotated"``
    (``;``-separated ``LAYERS:FORMAT`` items, ``LAYERS`` comma-separated layer indices).

    Formats are checked later (:class:`EngineConfig`); this only parses. No side effects.

    Args:
        text: the spelling.
        field_name: what the messages name (``kv_layer_dtypes``, ``--kv-layer-dtypes``, ``--formats ...``); ``None``
            for no name, where the caller adds it (argparse's ``argument --kv-layer-dtypes: ...``).

    Raises:
        ValueError: an empty or blank text (no map: leave the option out instead), an empty item (``"1:int4;"``,
            ``";"``), an item without ``:``, a layer that is not a non-negative integer, or a layer named twice
            (the message names ``field_name`` and the item).
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"{field_name}: {what}" if field_name else what)

    eg = "e.g. '17,20,24:int4_rotated;27:int2_rotated'"
    if not str(text).strip():
        raise bad(f"empty layer map {str(text)!r}: give LAYERS:FORMAT items separated by ';', {eg}, "
                  f"or leave it out for one format in every layer")
    out: dict[int, str] = {}
    for item in (t.strip() for t in str(text).split(";")):
        if not item:
            raise bad(f"{str(text)!r} has an empty item (a ';' with nothing on one side): give LAYERS:FORMAT items "
                      f"separated by ';', {eg}")
        layers, sep, fmt = item.rpartition(":")
        if not sep or not layers.strip() or not fmt.strip():
            raise bad(f"{item!r} is not LAYERS:FORMAT ({eg})")
        for tok in layers.split(","):
            tok = tok.strip()
            if not tok.isdigit():
                raise bad(f"layer {tok!r} in {item!r} is not a non-negative integer")
            i = int(tok)
            if i in out:
                raise bad(f"layer {i} is named twice ({out[i]!r} and {fmt.strip()!r})")
            out[i] = fmt.strip()
    return out


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Compute dtype from a name (``auto`` = ``float32``, the safe choice on CPUs) or a torch dtype.

    Raises:
        ValueError: an unsupported dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
        return dtype
    name = {"auto": "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(
        str(dtype).lower(), str(dtype).lower()
    )
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[name]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Cache, scheduling, tier and runtime settings of one engine.

    Built with user values, it validates every field in ``__post_init__`` and
    resolves the derived ones: :attr:`torch_dtype`, :attr:`kv_format` (the one
    format object every layer spec holds), :attr:`block_size_resolved` and
    :attr:`residual_tokens`. Static scales given as a path are read here.

    Attributes:
        kv_cache_dtype: KV format name or alias (see :mod:`kvpage.formats`).
        kv_cache_scales: calibrated static K/V scales for ``int8_static`` / ``fp8_static``:
            a scales file from ``kvpage calibrate`` (safetensors) or a
            :class:`~kvpage.scales.StaticScales`; required by those formats, ignored by others
            (vLLM's ``k_scale``/``v_scale``, FastDeploy's ``cache_int8`` scales).
        kv_layer_dtypes: per-layer precision: a mapping model layer index -> format name for full-attention
            layers that take another format than ``kv_cache_dtype`` (or its command-line spelling
            ``"17,20,24:int4_rotated;27,13:int2_rotated"``, :func:`parse_layer_dtypes`). Each format's layers form
            their own layer group (:meth:`~kvpage.spec.CacheSpec.build`); the fingerprint covers the map. Layer
            indices are checked against the model when the engine is built. An empty mapping (``{}``, e.g. a
            computed selection of no layers) is no per-layer format; an empty or blank string, or one with an
            empty ``;`` item, is refused (a typo, not a choice).
        kv_quant_residual_tokens: full-precision window of quantize-on-seal formats
            (``int4``, ``int3``, ``int2``) in tokens: the sealed blocks covering the most recent
            ``kv_quant_residual_tokens`` tokens keep a 16-bit copy that attention reads
            (KIVI's residual). ``None`` = the format's measured default (int4 0, int3 0, int2 32);
            ignored by other formats.
        block_size: tokens per block; ``None`` = 16, or the format's preferred size
            (32 for ``int4``/``int3``/``int2``, whose key quantization group is the block; they need
            at least :data:`MIN_SEALED_BLOCK_SIZE` tokens).
        kv_cache_memory_bytes: KV budget in bytes (vLLM's ``kv_cache_memory_bytes``);
            the block count is the largest that fits, scales and the side pools of
            ``int4``/``int3``/``int2`` included (see :mod:`kvpage.cache.capacity`). Default 512 MiB.
        kv_cache_memory_fraction: KV budget as a fraction in ``(0, 1]`` of the memory left
            for it: on CUDA, of the device's free memory after the weights are loaded and a
            forward pass of ``max_num_batched_tokens`` tokens has been profiled
            (``torch.cuda.mem_get_info`` less that pass's peak); on the CPU, of the RAM
            available after the weights are loaded (``MemAvailable``). Named apart from vLLM's
            ``gpu_memory_utilization`` on purpose: that one is a fraction of the device's
            *total* memory for the whole instance (weights and activations included), so 0.9
            there and 0.9 here are different budgets. Excludes ``kv_cache_memory_bytes`` and
            ``num_blocks``. See :mod:`kvpage.engine.memory`.
        num_blocks: exact block count (overrides the budget; vLLM's ``num_gpu_blocks_override``).
        dtype: compute dtype of the model: ``auto`` (float32), ``float32``, ``bfloat16``, ``float16``.
        weights_dtype: how a GGUF's weights are held (Hugging Face folders: ignored): ``auto`` (Q4_0/Q4_1/Q8_0
            projections and LM head run as shipped when ``dtype`` is bfloat16, else dequantized), ``as_shipped``
            (run as shipped whatever ``dtype``) or ``dequantized`` (every tensor in ``dtype``). See
            :func:`kvpage.model.loader.load_model`. On CUDA ``auto`` is ``dequantized`` and ``as_shipped`` is
            refused (the as-shipped kernel is kvpage's CPU one).
        max_model_len: longest sequence (prompt + output) in tokens, at most the model's context; default the context.
        num_threads: torch CPU threads (>= 1); ``None`` = the rule of :mod:`kvpage.engine.threads`
            (``OMP_NUM_THREADS`` if set, else the usable CPUs minus the machine's other load, at least 1,
            at most torch's default). Applied process-wide when the engine is built.
        device: ``"cpu"`` or ``"cuda"``.
        attention_backend: ``auto`` (the ``cpu`` kernels on the CPU, the ``triton`` ones on CUDA, where
            they serve the format on the device, else ``reference``), ``cpu`` (kvpage's C++ kernels) or
            ``triton`` (Triton kernels for CUDA; token-wise formats; needs the ``gpu`` extra), each refused at
            start-up, naming the format and device, where it cannot serve, or ``reference`` (the PyTorch
            oracle); vLLM's ``attention_backend``. See :mod:`kvpage.ops.backends`.
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per forward pass (the scheduler's per-step budget).
        enable_chunked_prefill: split long prompts across steps.
        enable_prefix_caching: reuse the KV of full blocks shared with earlier requests.
        prefix_caching_hash_algo: how full blocks are hashed for the prefix index, its events and the stores
            (vLLM's setting): ``kvpage`` (kvpage's own SHA-256 scheme, the default) or ``sha256_cbor``
            (vLLM's: SHA-256 of canonical CBOR, rooted at ``sha256_cbor($PYTHONHASHSEED or "vllm-none-hash")``,
            so a KV-aware router recomputes the same hashes from token ids; see :mod:`kvpage.cache.hashing`).
        swap_space: host (CPU) tier in GiB (vLLM's ``swap_space``); 0 = none. Blocks go there
            by ``kv_offload_policy`` and come back on a prefix hit (see :mod:`kvpage.cache.tiers.connector`).
        kv_offload_policy: ``write_through`` (back up each block when cached),
            ``write_through_selective`` (once used twice) or ``write_back`` (on device
            eviction) -- SGLang HiCache's write policies.
        preemption_mode: ``recompute`` or ``swap`` (vLLM's; ``swap`` copies a preempted
            request's blocks to the host tier and needs ``swap_space > 0``; quantize-on-seal
            formats fall back to recompute).
        kv_disk_dir: directory of a persistent, checksummed disk store of blocks (survives restarts).
        kv_disk_max_bytes: size cap of the disk store in bytes (LRU); ``None`` = unbounded.
        kv_store: URL of a store shared between instances (LMCache's remote backend): ``redis://host:port/db``
            (also ``rediss://``, ``unix://``), ``redis+cluster://h1:p1,h2:p2,...`` (a Redis Cluster), or
            ``disk:///dir`` (any scheme of
            :data:`~kvpage.cache.tiers.stores.STORES`).
        speculative_config: speculative decoding (vLLM's ``speculative_config``): a
            :class:`~kvpage.engine.speculative.config.SpeculativeConfig`, a dict of its fields
            (``{"method": "ngram", "num_speculative_tokens": 4}``) or that dict as JSON; ``None`` = off.
        kv_events_config: KV cache events on a ZeroMQ socket in vLLM's format (vLLM's ``kv_events_config``): a
            :class:`~kvpage.cache.kv_events.config.KVEventsConfig`, a dict of its fields
            (``{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}``) or that dict as JSON; ``None`` = off.
        kv_transfer_config: prefill/decode disaggregation over the shared store (vLLM's ``kv_transfer_config``): a
            :class:`~kvpage.cache.tiers.disagg.KVTransferConfig`, a dict of its fields (``{"kv_connector":
            "KVPageStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_store": URL}}``) or
            that dict as JSON; needs a store (``kv_store`` here or in ``kv_connector_extra_config``); ``None`` = off.

    Raises:
        ValueError: a bad field (the message names it).
        UnknownKVFormatError: unknown ``kv_cache_dtype``.
        FileNotFoundError / StaticScalesError: ``kv_cache_scales`` names no file or a bad one.
    """

    kv_cache_dtype: str = "auto"
    kv_cache_scales: str | Path | StaticScales | None = None
    kv_layer_dtypes: Mapping[int, str] | str | None = None
    kv_quant_residual_tokens: int | None = None
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    num_blocks: int | None = None
    dtype: str | torch.dtype = "auto"
    weights_dtype: str = "auto"
    max_model_len: int | None = None
    num_threads: int | None = None
    device: str = "cpu"
    attention_backend: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    swap_space: float = 0.0
    kv_offload_policy: str = "write_through"
    preemption_mode: str = "recompute"
    kv_disk_dir: str | Path | None = None
    kv_disk_max_bytes: int | None = None
    kv_store: str | None = None
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    #: Derived: the compute dtype.
    torch_dtype: torch.dtype = field(init=False)
    #: Derived: ``weights_dtype`` for the loader: ``auto`` off the CPU is ``dequantized`` (the as-shipped kernel is CPU-only).
    weights_dtype_resolved: str = field(init=False)
    #: Derived: the main layers' KV format object.
    kv_format: KVFormat = field(init=False, repr=False)
    #: Derived: ``kv_layer_dtypes`` resolved: layer -> format object, only layers whose format differs from
    #: :attr:`kv_format` (``None``: no such layer; the spec is then exactly that of no map).
    kv_layer_formats: dict[int, KVFormat] | None = field(init=False, repr=False)
    #: Derived: tokens per block (the format's preferred size when ``block_size`` is ``None``).
    block_size_resolved: int = field(init=False)
    #: Derived: the full-precision window of block-wise formats, in tokens.
    residual_tokens: int = field(init=False)
    #: Derived: the static scales, read once (``None`` without ``kv_cache_scales``).
    static_scales: StaticScales | None = field(init=False, repr=False)
    #: Derived: the tier policy.
    offload: OffloadConfig = field(init=False, repr=False)
    #: Derived: the speculative decoding settings (``None`` = off).
    speculative: SpeculativeConfig | None = field(init=False, repr=False)
    #: Derived: the draft model's layers' KV format (``speculative_config`` method ``draft_model``; else ``None``):
    #: ``draft_kv_cache_dtype``, default the main format when it is token-wise, else ``int8`` (draft layers are
    #: token-wise). Resolved here once; the spec's draft group takes it.
    draft_kv_format: KVFormat | None = field(init=False, repr=False)
    #: Derived: the stores below the host tier, parsed once, in lookup order: ``kv_disk_dir`` (with
    #: ``kv_disk_max_bytes``), then ``kv_store``.
    kv_stores: tuple[StoreURL, ...] = field(init=False, repr=False)
    #: Derived: the KV events settings (``None`` = off: not given, disabled or the ``null`` publisher).
    kv_events: KVEventsConfig | None = field(init=False, repr=False)
    #: Derived: the prefill/decode role (``None`` = off).
    kv_transfer: KVTransferConfig | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        put("torch_dtype", resolve_dtype(self.dtype))
        check_weights_dtype(self.weights_dtype)
        on_cpu = str(self.device).startswith("cpu")
        put("weights_dtype_resolved", self.weights_dtype if on_cpu or self.weights_dtype != "auto" else "dequantized")
        fmt = get_format(canonical_format_name(self.kv_cache_dtype, self.torch_dtype), self.torch_dtype)
        put("kv_format", fmt)
        put("kv_layer_formats", self._check_layer_dtypes(fmt))
        fmts = [fmt, *(self.kv_layer_formats or {}).values()]
        self._check_positive_int("block_size", self.block_size, allow_none=True)
        put("block_size_resolved", max(f.preferred_block_size for f in fmts) if self.block_size is None
            else self.block_size)
        for f in fmts:
            if f.block_wise and self.block_size_resolved < MIN_SEALED_BLOCK_SIZE:
                what = "kv_cache_dtype" if f is fmt else "kv_layer_dtypes format"
                raise ValueError(
                    f"block_size={self.block_size} is too small for {what}={f.name!r}: its key scale and "
                    f"zero point are per channel per block (the block is the key quantization group), so "
                    f"block_size must be >= {MIN_SEALED_BLOCK_SIZE} (default {f.preferred_block_size})")
        r = fmt.default_residual_tokens if self.kv_quant_residual_tokens is None else self.kv_quant_residual_tokens
        if not _is_int(r) or r < 0:
            raise ValueError(f"kv_quant_residual_tokens must be an integer >= 0, got {self.kv_quant_residual_tokens!r}")
        put("residual_tokens", r)
        if self.kv_cache_memory_bytes is not None and (not _is_int(self.kv_cache_memory_bytes)
                                                        or self.kv_cache_memory_bytes < 0):
            raise ValueError(f"kv_cache_memory_bytes must be an integer >= 0, got {self.kv_cache_memory_bytes!r}")
        self._check_positive_int("num_blocks", self.num_blocks, allow_none=True)
        self._check_budget_exclusive()
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 tokens (or None for the model's context), "
                             f"got {self.max_model_len!r}")
        self._check_positive_int("num_threads", self.num_threads, allow_none=True)
        if str(self.device).split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.weights_dtype == "as_shipped" and not str(self.device).startswith("cpu"):
            raise ValueError(f"weights_dtype='as_shipped' runs on the CPU only (torch's int4 CPU kernel), not on "
                             f"device={self.device!r}: use weights_dtype='auto' or 'dequantized'")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {self.attention_backend!r}")
        self._check_positive_int("max_num_seqs", self.max_num_seqs)
        self._check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        self._check_tiers()
        if self.kv_cache_scales is not None and not isinstance(self.kv_cache_scales, (str, Path, StaticScales)):
            raise ValueError(f"kv_cache_scales must be a scales file path or a StaticScales, "
                             f"got {type(self.kv_cache_scales).__name__} {self.kv_cache_scales!r}")
        scales = None if self.kv_cache_scales is None else StaticScales.coerce(self.kv_cache_scales)
        put("static_scales", scales)
        if scales is None and needs_static_scales(fmt):  # fails here, before any model loads
            raise missing_scales_error(fmt.name)
        for i, f in (self.kv_layer_formats or {}).items():
            if scales is None and needs_static_scales(f):
                raise missing_scales_error(f.name, i, format_group_name(f))
        self._check_speculative()
        ke = None if self.kv_events_config is None else KVEventsConfig.coerce(self.kv_events_config)
        put("kv_events", ke if ke is not None and ke.active else None)

    def _check_layer_dtypes(self, base: KVFormat) -> dict[int, KVFormat] | None:
        """``kv_layer_dtypes`` parsed and resolved (layers whose format differs from ``base`` only; ``None``: none).

        Raises:
            ValueError: not a mapping or a string, a bad layer index or spelling (names the field).
            UnknownKVFormatError: an unknown format (names the field and the layer).
        """
        m = self.kv_layer_dtypes
        if m is None:
            return None
        if isinstance(m, str):
            m = parse_layer_dtypes(m)
        if not isinstance(m, Mapping):
            raise ValueError(f"kv_layer_dtypes must be a mapping layer index -> format name or a string like "
                             f"'17,20:int4_rotated;27:int2_rotated', got {type(m).__name__} {m!r}")
        out: dict[int, KVFormat] = {}
        for i, name in m.items():
            if not _is_int(i) or i < 0:
                raise ValueError(f"kv_layer_dtypes: layer index {i!r} is not a non-negative integer")
            try:
                f = name if isinstance(name, KVFormat) else get_format(canonical_format_name(name, self.torch_dtype),
                                                                       self.torch_dtype)
            except UnknownKVFormatError as e:
                raise UnknownKVFormatError(f"kv_layer_dtypes: layer {i}: {e}") from None
            if f.name != base.name:
                out[int(i)] = f
        return out or None

    def _check_speculative(self) -> None:
        sc = None if self.speculative_config is None else SpeculativeConfig.coerce(self.speculative_config)
        object.__setattr__(self, "speculative", sc)
        object.__setattr__(self, "draft_kv_format", None)
        if sc is None:
            return
        if sc.method == "draft_model":
            if sc.draft_kv_cache_dtype is not None:
                draft = self._check_draft_format(sc.draft_kv_cache_dtype)
            elif self.kv_format.block_wise:
                draft = get_format("int8", self.torch_dtype)
            else:
                draft = self.kv_format
            object.__setattr__(self, "draft_kv_format", draft)
        elif sc.draft_kv_cache_dtype is not None:
            self._check_draft_format(sc.draft_kv_cache_dtype)
        if isinstance(sc.model, str) and not Path(sc.model).expanduser().exists():
            raise ValueError(f"speculative_config.model={sc.model!r}: no such file or folder (give the draft model's "
                             f".gguf file or Hugging Face folder)")

    def _check_draft_format(self, name: str) -> KVFormat:
        try:
            draft = get_format(canonical_format_name(name, self.torch_dtype), self.torch_dtype)
        except UnknownKVFormatError as e:
            raise UnknownKVFormatError(f"speculative_config.draft_kv_cache_dtype: {e}") from None
        if draft.block_wise:
            raise ValueError(f"speculative_config.draft_kv_cache_dtype={name!r} quantizes on seal; "
                             f"draft layers take a token-wise format (auto, bfloat16, fp8, int8, ...)")
        if needs_static_scales(draft):
            raise ValueError(f"speculative_config.draft_kv_cache_dtype={name!r} needs calibrated "
                             f"scales of the draft layers; give the draft a dynamic format (fp8, int8, ...)")
        return draft

    def sizing(self, max_model_len: int) -> CacheSizing:
        """The settings the cache's side pools and window slots depend on, for requests of at most
        ``max_model_len`` tokens (``max_model_len`` resolved against the model's context)."""
        return CacheSizing(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                           max_model_len=max_model_len, residual_tokens=self.residual_tokens,
                           num_lookahead_tokens=self.num_lookahead_tokens, model_dtype=self.torch_dtype,
                           group_residual_tokens=self._group_residuals())

    def residual_tokens_for(self, group: str) -> int:
        """The full-precision window in tokens of the layer group called ``group`` (a ``main@<format>`` group of
        ``kv_layer_dtypes`` keeps its own format's default unless ``kv_quant_residual_tokens`` is given). No side
        effects."""
        return dict(self._group_residuals()).get(group, self.residual_tokens)

    def _group_residuals(self) -> tuple[tuple[str, int], ...]:
        """Each ``main@<format>`` group's window: its own format's default unless ``kv_quant_residual_tokens``
        is given (which then holds for every group)."""
        if self.kv_quant_residual_tokens is not None or not self.kv_layer_formats:
            return ()
        fmts = {f.name: f for f in self.kv_layer_formats.values()}
        return tuple((format_group_name(f), f.default_residual_tokens) for _, f in sorted(fmts.items()))

    @property
    def num_lookahead_tokens(self) -> int:
        """Draft slots a speculating request reserves per step (``num_speculative_tokens``; 0 without speculation)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def _check_positive_int(self, name: str, value: Any, *, allow_none: bool = False) -> None:
        if value is None and allow_none:
            return
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def _check_budget_exclusive(self) -> None:
        f = self.kv_cache_memory_fraction
        if f is None:
            return
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be a number in (0, 1], got {f!r}")
        given = [n for n in ("kv_cache_memory_bytes", "num_blocks") if getattr(self, n) is not None]
        if given:
            raise ValueError(f"kv_cache_memory_fraction and {' and '.join(given)} both size the KV cache; give one")

    def _check_transfer(self) -> KVTransferConfig | None:
        """Resolve ``kv_transfer_config``; its ``kv_store`` becomes the engine's (equal to ``kv_store`` if both)."""
        kt = None if self.kv_transfer_config is None else KVTransferConfig.coerce(self.kv_transfer_config)
        object.__setattr__(self, "kv_transfer", kt)
        if kt is None:
            return None
        url = kt.kv_store
        if url is not None:
            if self.kv_store is not None and self.kv_store != url:
                raise ValueError(f"kv_store={self.kv_store!r} and kv_transfer_config.kv_connector_extra_config."
                                 f"kv_store={url!r} name two stores; give one")
            object.__setattr__(self, "kv_store", url)
        if self.kv_store is None and self.kv_disk_dir is None:
            raise ValueError("kv_transfer_config needs a store the instances share: set kv_store "
                             "(redis://host:port/db) or kv_connector_extra_config.kv_store")
        return kt

    def _check_tiers(self) -> None:
        s = self.swap_space
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < math.inf:
            raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {s!r}")
        kt = self._check_transfer()
        object.__setattr__(self, "offload", OffloadConfig(
            write_policy=self.kv_offload_policy, preemption_mode=self.preemption_mode,
            store_reads=kt is None or kt.is_kv_consumer, store_writes=kt is None or kt.is_kv_producer))
        if self.preemption_mode == "swap" and s == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (GiB) > 0")
        d = self.kv_disk_dir
        if d is not None and (not isinstance(d, (str, Path)) or not str(d).strip()):
            raise ValueError(f"kv_disk_dir must be a directory path (str or Path), got {d!r}")
        if self.kv_store is not None and not isinstance(self.kv_store, str):
            raise ValueError(f"kv_store must be a store URL string (redis://host:port/db), got {self.kv_store!r}")
        if self.kv_disk_max_bytes is not None:
            if not _is_int(self.kv_disk_max_bytes) or self.kv_disk_max_bytes <= 0:
                raise ValueError(f"kv_disk_max_bytes must be a positive number of bytes, got {self.kv_disk_max_bytes!r}")
            if self.kv_disk_dir is None:
                raise ValueError("kv_disk_max_bytes needs kv_disk_dir")
        stores: list[StoreURL] = []
        if d is not None:
            opts = {} if self.kv_disk_max_bytes is None else {"max_bytes": self.kv_disk_max_bytes}
            stores.append(StoreURL("disk", "disk", str(d), tuple(opts.items())))
        if self.kv_store is not None:
            if "://" not in self.kv_store:
                raise ValueError(f"kv_store must be a store URL (redis://host:port/db, disk:///dir), got "
                                 f"{self.kv_store!r}; for a local directory use kv_disk_dir")
            try:
                stores.append(parse_store_url(self.kv_store))
            except ValueError as e:
                raise ValueError(f"kv_store: {e}") from None
        tiers = [u.tier for u in stores]
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"kv_disk_dir and kv_store={self.kv_store!r} are both {tiers[0]} stores; give one")
        object.__setattr__(self, "kv_stores", tuple(stores))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The settings a user gives (the derived fields excluded)."""
        return tuple(f.name for f in fields(cls) if f.init)

    @property
    def has_tiers(self) -> bool:
        """Whether any tier below the device is asked for (host memory, disk or Redis)."""
        return self.swap_space > 0 or self.kv_disk_dir is not None or bool(self.kv_store)

    @property
    def kv_budget_bytes(self) -> int:
        """The KV budget in bytes (``kv_cache_memory_bytes``, else :data:`DEFAULT_KV_CACHE_BYTES`).

        With ``kv_cache_memory_fraction`` the budget depends on the machine: the builder resolves it
        with :func:`kvpage.engine.memory.resolve_kv_budget`, not from this property.
        """
        return DEFAULT_KV_CACHE_BYTES if self.kv_cache_memory_bytes is None else self.kv_cache_memory_bytes
