"""``LLM``: load a model, build its paged KV cache from a :class:`~kvpage.spec.CacheSpec`, and generate.

The API mirrors vLLM's offline ``LLM``: ``LLM(model, kv_cache_dtype=...,
block_size=..., kv_cache_memory_bytes=...)`` then ``generate(prompts,
SamplingParams(...))``, ``chat(messages, ...)`` or ``generate_stream(...)``.
Generation runs on the continuous-batching :class:`~kvpage.engine.engine.LLMEngine`
(scheduler, prefix cache, chunked prefill, preemption by recompute).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.tail import TailPool, TailTable
from kvpage.engine.engine import LLMEngine
from kvpage.engine.model_runner import ModelRunner
from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sampling import SamplingParams
from kvpage.engine.scheduler import SchedulerConfig
from kvpage.formats import BlockFormat, canonical_format_name, get_format
from kvpage.scales import StaticScales
from kvpage.spec import CacheSpec

if TYPE_CHECKING:
    from kvpage.model.loader import LoadedModel

#: A prompt: text, or a dict ``{"prompt_token_ids": [...]}`` (vLLM's ``TokensPrompt``).
PromptType = Union[str, dict[str, Any]]

#: KV budget when neither ``kv_cache_memory_bytes`` nor ``num_blocks`` is given.
DEFAULT_KV_CACHE_BYTES = 512 * 2**20

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _check_tier_args(swap_space: float, policy: str, preemption_mode: str, disk_dir: object,
                     disk_max_bytes: int | None, store: str | None) -> None:
    """Fail on bad tier arguments before the model loads (the same checks run again when the tiers are built).

    Raises:
        ValueError: a bad ``swap_space``, policy, mode, disk cap or store URL.
    """
    from kvpage.cache.tiers.policy import OffloadConfig

    OffloadConfig(write_policy=policy, preemption_mode=preemption_mode)
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or not 0 <= swap_space < float("inf"):
        raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {swap_space!r}")
    if preemption_mode == "swap" and swap_space == 0:
        raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (GiB) > 0")
    if disk_max_bytes is not None:
        if isinstance(disk_max_bytes, bool) or not isinstance(disk_max_bytes, int) or disk_max_bytes <= 0:
            raise ValueError(f"kv_disk_max_bytes must be a positive number of bytes, got {disk_max_bytes!r}")
        if disk_dir is None:
            raise ValueError("kv_disk_max_bytes needs kv_disk_dir")
    if store is not None and not str(store).lower().startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"kv_store must be a redis://host:port/db URL, got {store!r}")


class LLM:
    """A model served on a paged KV cache.

    Args:
        model: path to a ``.gguf`` file or a Hugging Face folder (config.json +
            safetensors); ``None`` loads the bundled SmolLM2-135M-Instruct GGUF;
            a :class:`~kvpage.model.loader.LoadedModel` is used as is (several
            engines can share one set of weights; its dtype must match ``dtype``).
        kv_cache_dtype: KV format name or alias (see :mod:`kvpage.formats`).
        kv_cache_scales: calibrated static K/V scales for ``int8_static`` / ``fp8_static``:
            a scales file from ``kvpage calibrate`` (safetensors) or a
            :class:`~kvpage.scales.StaticScales`; required by those formats, ignored by others
            (vLLM's ``k_scale``/``v_scale``, FastDeploy's ``cache_int8`` scales).
        kv_quant_residual_tokens: full-precision window of quantize-on-seal formats
            (``int4``, ``int2``) in tokens: the sealed blocks covering the most recent
            ``kv_quant_residual_tokens`` tokens keep a 16-bit copy that attention reads
            (KIVI's residual). ``None`` = the format's measured default (int4 0, int2 32);
            ignored by other formats.
        block_size: tokens per block; ``None`` = 16, or the format's preferred size
            (32 for ``int4``/``int2``, whose key quantization group is the block).
        kv_cache_memory_bytes: KV budget in bytes (vLLM's ``kv_cache_memory_bytes``);
            the block count is the largest that fits, scales included.
        num_blocks: exact block count (overrides the budget; vLLM's ``num_gpu_blocks_override``).
        dtype: compute dtype of the model: ``auto`` (float32), ``float32``, ``bfloat16``, ``float16``.
        max_model_len: longest sequence (prompt + output) in tokens, at most the model's context; default the context.
        num_threads: torch CPU threads (>= 1); ``None`` leaves torch's setting (sets it process-wide).
        device: ``"cpu"`` or ``"cuda"``.
        progress: show a progress bar while loading the model.
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per forward pass (the scheduler's per-step budget).
        enable_chunked_prefill: split long prompts across steps.
        enable_prefix_caching: reuse the KV of full blocks shared with earlier requests.
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
        kv_store: ``redis://host:port/db`` of a Redis store shared between instances (LMCache's remote backend).

    Raises:
        ModelNotFoundError: the model path does not exist (or the bundled model is not installed).
        UnknownKVFormatError: unknown ``kv_cache_dtype``.
        StaticScalesError: a static-scale format without scales, or scales missing or
            invalid for a layer (names the layer and the tensor; raised at load time).
        FileNotFoundError: ``kv_cache_scales`` names no file.
        ValueError: bad sizes, thread count, dtype, or ``cuda`` without a CUDA device.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        kv_cache_dtype: str = "auto",
        kv_cache_scales: str | Path | StaticScales | None = None,
        kv_quant_residual_tokens: int | None = None,
        block_size: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        num_blocks: int | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        num_threads: int | None = None,
        device: str = "cpu",
        progress: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        swap_space: float = 0.0,
        kv_offload_policy: str = "write_through",
        preemption_mode: str = "recompute",
        kv_disk_dir: str | Path | None = None,
        kv_disk_max_bytes: int | None = None,
        kv_store: str | None = None,
    ) -> None:
        from kvpage.model.loader import LoadedModel, load_model

        if num_threads is not None:
            if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
                raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
            torch.set_num_threads(num_threads)
        self.dtype = resolve_dtype(dtype)
        fmt = get_format(canonical_format_name(kv_cache_dtype, self.dtype), self.dtype)
        if block_size is None:
            block_size = fmt.preferred_block_size
        if kv_quant_residual_tokens is None:
            kv_quant_residual_tokens = fmt.default_residual_tokens
        if (isinstance(kv_quant_residual_tokens, bool) or not isinstance(kv_quant_residual_tokens, int)
                or kv_quant_residual_tokens < 0):
            raise ValueError(f"kv_quant_residual_tokens must be an integer >= 0, got {kv_quant_residual_tokens!r}")
        self.kv_quant_residual_tokens = kv_quant_residual_tokens
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 tokens (or None for the model's context), "
                             f"got {max_model_len!r}")
        _check_tier_args(swap_space, kv_offload_policy, preemption_mode, kv_disk_dir, kv_disk_max_bytes, kv_store)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but this torch build sees no CUDA device; use device='cpu'")
        # Build the spec first: an unknown kv_cache_dtype (or a static format without scales) fails before the
        # model loads; a scales file is read now too, and checked layer by layer when the real spec is built.
        self._spec_args = dict(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        scales = None if kv_cache_scales is None else StaticScales.coerce(kv_cache_scales)
        if scales is None:
            CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=1, model_dtype=self.dtype, **self._spec_args)
        else:
            canonical_format_name(kv_cache_dtype, self.dtype)
        if isinstance(model, LoadedModel):
            loaded = model
            weight_dtype = next(loaded.model.parameters()).dtype
            if weight_dtype != self.dtype:
                raise ValueError(f"the loaded model is {weight_dtype}, but dtype={self.dtype} was asked for")
        else:
            loaded = load_model(model, dtype=self.dtype, progress=progress)
        self.model = loaded.model.to(self.device).eval()
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = Path(loaded.path)
        self.spec = CacheSpec.build(
            num_layers=self.config.num_layers,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            model_dtype=self.dtype,
            model_name=self.model_path.name,
            static_scales=scales,
            **self._spec_args,
        )
        self.controller = CacheController(self.spec, self.device)
        # Quantize-on-seal layers keep open blocks, window copies and first-block copies in a tail pool
        # (kvpage.cache.tail), sized per running request and paid for out of the KV budget.
        seals = any(isinstance(g.layer.format, BlockFormat) for g in self.spec.groups)
        window_blocks = -(-kv_quant_residual_tokens // self.spec.block_size)
        tail_slots, sink_slots = max_num_seqs * (1 + window_blocks), 2 * max_num_seqs
        tail_bytes = TailPool.bytes_for(self.spec, self.dtype, tail_slots, sink_slots) if seals else 0
        if num_blocks is None:
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_memory_bytes is None else int(kv_cache_memory_bytes)
            num_blocks = self.controller.num_blocks_for_budget(max(0, budget - tail_bytes)).num_blocks
            if num_blocks <= 0:
                raise ValueError(
                    f"kv_cache_memory_bytes={budget} holds no block of {self.spec.bytes_per_block} bytes; raise it"
                )
        self.num_blocks = int(num_blocks)
        caches = self.controller.initialize_kv_cache(self.num_blocks)
        from kvpage.cache.tiers.host import build_offload

        self.offload = build_offload(  # host tier (C08: a failed host allocation stops here), stores
            self.controller, swap_space=swap_space, kv_offload_policy=kv_offload_policy,
            preemption_mode=preemption_mode, kv_disk_dir=None if kv_disk_dir is None else str(kv_disk_dir),
            kv_disk_max_bytes=kv_disk_max_bytes, kv_store=kv_store,
        )
        self.tail: TailPool | None = None
        if seals:
            table = TailTable(self.spec.block_size, tail_slots, sink_slots, window_blocks)
            self.tail = TailPool(self.spec, table, self.dtype, self.device)
        self.runner = ModelRunner(self.model, self.spec, caches, self.device, tail=self.tail)
        context = self.config.max_position_embeddings
        if max_model_len is not None and max_model_len > context:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {context} tokens")
        self.max_model_len = context if max_model_len is None else max_model_len
        self.engine = LLMEngine(
            self.runner,
            self.tokenizer,
            num_blocks=self.num_blocks,
            block_size=self.spec.block_size,
            eos_token_ids=set(self.config.eos_token_ids),
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
            scheduler_config=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
            enable_prefix_caching=enable_prefix_caching,
            offload=self.offload,
        )
        if self.tail is not None:
            # Tail entries belong to a block's content: dropped when the pool hands the block out anew,
            # reclaimed first once the block is neither in use nor cached.
            pool = self.engine.manager.pool
            pool.on_allocate = self.tail.table.invalidate
            self.tail.table.is_live = lambda b: pool.ref_count(b) > 0 or pool.block_hash(b) is not None
            self.tail.table.is_in_use = lambda b: pool.ref_count(b) > 0
            table = self.tail.table
            self.engine.manager.first_block_ok = lambda b: table.sink_of(b) is not None
            # A block written while generating was computed reading its open block at 16 bits (and the
            # window); a prefill of the same tokens reads them sealed, so such blocks are not shared.
            self.engine.manager.index_generated_blocks = False

    # -- facts ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one cached token costs across all layers (scales included), from the spec."""
        return self.spec.bytes_per_token

    @property
    def model_dtype_kv_bytes_per_token(self) -> float:
        """KV bytes per token if the cache were stored in the model's compute dtype (the ``auto`` format)."""
        ref = CacheSpec.build(
            num_layers=self.config.num_layers,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            model_dtype=self.dtype,
            block_size=self.spec.block_size,
        )
        return ref.bytes_per_token

    @property
    def max_cache_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.num_blocks * self.spec.block_size

    def close(self) -> None:
        """Close the KV stores (Redis connections, disk store handles); generation must not follow."""
        if self.offload is not None:
            for _, store in self.offload.stores:
                store.close()

    def reset_kv_cache(self) -> None:
        """Free the whole KV pool and allocate it afresh (vLLM's ``sleep()`` + ``wake_up()`` of the KV cache).

        Empties the prefix cache, then re-allocates every layer's tensors from the
        same spec; calibrated static scales live in the spec, so they are kept
        (vLLM issue 25800, case C12).

        Raises:
            RuntimeError: requests are still running or waiting.
        """
        if self.engine.has_unfinished_requests():
            raise RuntimeError("reset_kv_cache() needs an idle engine; finish or abort the running requests first")
        self.engine.manager.reset_prefix_cache()
        self.runner.caches = self.controller.initialize_kv_cache(self.num_blocks)
        if self.tail is not None:
            self.tail.table.reset()

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Token ids of a text prompt (no special tokens added) or of a ``{"prompt_token_ids": ...}`` dict."""
        if isinstance(prompt, dict):
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            return prompt.get("prompt"), ids
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt is a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def chat_prompt(self, messages: str | Sequence[dict[str, str]]) -> dict[str, Any]:
        """Apply the tokenizer's chat template (with the generation prompt) to a message list or a single user message."""
        from kvpage.model.loader import apply_chat_template

        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not any(str(m.get("content") or "").strip() for m in messages if m.get("role") == "user"):
            raise ValueError("empty prompt: the conversation has no non-blank user message")
        ids = apply_chat_template(self.tokenizer, messages)
        return {"prompt": self.tokenizer.decode(ids), "prompt_token_ids": ids}

    # -- generation ----------------------------------------------------------------------------
    def chat(
        self,
        messages: str | Sequence[dict[str, str]] | Sequence[str | Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate answers to one conversation or a list of them (each a message list or a user string)."""
        if isinstance(messages, str) or (messages and isinstance(messages[0], dict)):
            convs: list[Any] = [messages]
        else:
            convs = list(messages)
        return self.generate([self.chat_prompt(c) for c in convs], sampling_params)

    def _add(self, prompts: PromptType | Sequence[PromptType],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        ids_out: list[str] = []
        try:
            for (text, ids), sp in zip(encoded, params_list):
                ids_out.append(self.engine.add_request(text, ids, sp).request_id)
        except Exception:
            for rid in ids_out:
                self.engine.abort_request(rid)
            raise
        return ids_out

    def generate_stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yield each request's incremental output as soon as a step produces it.

        Every yielded :class:`RequestOutput` carries the cumulative text and
        tokens plus ``delta_text``/``delta_token_ids`` since that request's
        previous output; the last one of a request has ``finished=True``.
        Closing the iterator early aborts the requests still running.
        """
        pending = set(self._add(prompts, sampling_params))
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:
                self.engine.abort_request(rid)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` with continuous batching; results in input order.

        Args:
            prompts: one prompt or a list (text, or ``{"prompt_token_ids": [...]}``).
            sampling_params: one for all, or one per prompt; default ``SamplingParams()``.

        Returns:
            One finished :class:`RequestOutput` per prompt.

        Raises:
            PromptTooLongError: a prompt exceeds the context or cannot fit in the whole cache
                (nothing is queued then).
            ValueError: empty prompt, or a params list of the wrong length.
        """
        final: dict[str, RequestOutput] = {}
        ids = self._add(prompts, sampling_params)
        wanted = set(ids)
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
        finally:
            for rid in wanted - set(final):
                self.engine.abort_request(rid)
        return [final[i] for i in ids]
