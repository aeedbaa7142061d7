"""``LLM``: load a model, build its paged KV cache from a :class:`~kvpage.spec.CacheSpec`, and generate.

The API mirrors vLLM's offline ``LLM``: ``LLM(model, kv_cache_dtype=...,
block_size=..., kv_cache_memory_bytes=...)`` then ``generate(prompts,
SamplingParams(...))``, ``chat(messages, ...)`` or ``generate_stream(...)``.
Generation runs on the continuous-batching :class:`~kvpage.engine.engine.LLMEngine`
(scheduler, prefix cache, chunked prefill, preemption). This module is API only:
settings are validated by :class:`~kvpage.engine.config.EngineConfig` and the
engine is assembled by :func:`~kvpage.engine.build.build_engine`.
"""
from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from kvpage.cache.controller import LayerCache
from kvpage.cache.requests import KVCacheStats
from kvpage.cache.tiers.connector import TieredConnector
from kvpage.cache.capacity import CapacityReport
from kvpage.engine.build import BuiltEngine, build_engine
from kvpage.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig, resolve_dtype
from kvpage.engine.forced import ForcedSequence
from kvpage.engine.output_router import OutputRouter
from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sampling import SamplingParams
from kvpage.engine.sizing import startup_line
from kvpage.engine.threads import apply_num_threads
from kvpage.engine.validate import check_messages, check_prompt
from kvpage.errors import KVPageError, prefix_message
from kvpage.model.encode import encode_text
from kvpage.spec import CacheSpec

if TYPE_CHECKING:
    from kvpage.model.loader import LoadedModel

__all__ = ["DEFAULT_KV_CACHE_BYTES", "LLM", "PromptType", "resolve_dtype"]

#: A prompt: text, or a dict ``{"prompt_token_ids": [...]}`` (vLLM's ``TokensPrompt``).
PromptType = Union[str, dict[str, Any]]


class LLM:
    """A model served on a paged KV cache.

    Args:
        model: path to a ``.gguf`` file or a Hugging Face folder (config.json +
            safetensors); ``None`` loads the bundled SmolLM2-135M-Instruct GGUF;
            a :class:`~kvpage.model.loader.LoadedModel` is used as is (several
            engines can share one set of weights; its dtype must match ``dtype``).
        progress: show a progress bar while loading the model, and print the start-up line to stderr
            (torch threads and the rule that chose them, KV format, blocks, tokens, bytes, side pools;
            see :func:`~kvpage.engine.sizing.startup_line`).
        config: a ready :class:`~kvpage.engine.config.EngineConfig`, or none and its fields as keywords
            (vLLM's names: ``kv_cache_dtype``, ``block_size``, ``kv_cache_memory_bytes``, ``num_blocks``,
            ``dtype``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``swap_space``,
            ``preemption_mode``, ...; each is documented there; ``kv_layer_dtypes={17: "int4_rotated", ...}``
            gives chosen layers another format than ``kv_cache_dtype``: per-layer precision).

    Raises:
        ModelNotFoundError: the model path does not exist (or the bundled model is not installed).
        UnknownKVFormatError: unknown ``kv_cache_dtype`` or ``kv_layer_dtypes`` format.
        StaticScalesError: a static-scale format without scales, or scales missing or
            invalid for a layer (names the layer and the tensor; raised at load time).
        FileNotFoundError: ``kv_cache_scales`` names no file.
        ValueError: bad sizes, thread count, dtype, or ``cuda`` without a CUDA device; a ``kv_layer_dtypes``
            layer out of range, named twice, a draft or a sliding-window layer (the message names the field).
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        progress: bool = True,
        config: EngineConfig | None = None,
        **engine_args: Any,
    ) -> None:
        from kvpage.model.loader import LoadedModel, load_model, weight_bytes

        if config is not None and engine_args:
            raise ValueError(f"give either config or engine settings, not both (got {sorted(engine_args)})")
        unknown = sorted(set(engine_args) - set(EngineConfig.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}; engine settings are "
                            f"{', '.join(EngineConfig.field_names())}")
        cfg = config if config is not None else EngineConfig(**engine_args)  # fails before the model loads
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but this torch build sees no CUDA device; use device='cpu'")
        self.threads = apply_num_threads(cfg.num_threads)  # None = the rule of kvpage.engine.threads
        if isinstance(model, LoadedModel):
            loaded = model
            weight_dtype = next(loaded.model.parameters()).dtype
            if weight_dtype != cfg.torch_dtype:
                raise ValueError(f"the loaded model is {weight_dtype}, but dtype={cfg.torch_dtype} was asked for")
        else:
            loaded = load_model(model, dtype=cfg.torch_dtype, progress=progress, weights_dtype=cfg.weights_dtype_resolved)
        self.engine_config = cfg
        self.dtype = cfg.torch_dtype
        self.device = torch.device(cfg.device)
        self.model = loaded.model.to(self.device).eval()
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = Path(loaded.path)
        #: Bytes of the loaded weights (parameters, GGUF blocks kept as shipped, oneDNN-packed copies):
        #: :func:`~kvpage.model.loader.weight_bytes`.
        self.weight_bytes = weight_bytes(self.model)
        self._built: BuiltEngine = build_engine(cfg, loaded, self.model)
        self.spec: CacheSpec = self._built.spec
        self.controller = self._built.controller
        self.engine = self._built.engine
        self._router = OutputRouter(self.engine)  # outputs reach their own generate call or stream
        self.num_blocks = self._built.num_blocks
        self.max_model_len = self._built.max_model_len
        self.kv_quant_residual_tokens = cfg.residual_tokens
        if progress:
            print(startup_line(self.threads, self._built.capacity, self._built.budget), file=sys.stderr, flush=True)

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
            has_value=self.config.kv_has_value,
            model_dtype=self.dtype,
            block_size=self.spec.block_size,
        )
        return ref.bytes_per_token

    @property
    def max_cache_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.num_blocks * self.spec.block_size

    @property
    def side_pool_bytes(self) -> int:
        """Bytes of the tail pools of block-wise formats (open blocks, window and first-block copies); else 0."""
        return self._built.side_pool_bytes

    @property
    def capacity(self) -> CapacityReport:
        """What the KV cache allocated and holds: blocks, bytes, side pools, tokens, ratio to the model-dtype cache."""
        return self._built.capacity

    @property
    def kv_caches(self) -> dict[int, LayerCache]:
        """Global layer index -> that layer's device cache tensors (read-only use; re-allocated by :meth:`reset_kv_cache`)."""
        return self._built.caches

    @property
    def kv_connector(self) -> TieredConnector | None:
        """The tiers below the device (host tier, disk and Redis stores; their scheduler half), or ``None`` without
        tiers."""
        return self._built.connector

    def kv_cache_stats(self) -> KVCacheStats:
        """The KV cache's counters now (device blocks, prefix hits; tier counters in ``.tiers``)."""
        return self.engine.kv.stats()

    def open_sequence(self, *, prompt_len: int = 0) -> ForcedSequence:
        """A teacher-forced sequence over the real paged cache, for perplexity, KL and flip rates.

        ``with llm.open_sequence() as seq: logits = seq.feed(token_ids)`` writes the tokens' KV
        in this cache's format and returns float32 logits (see
        :class:`~kvpage.engine.forced.ForcedSequence`); its blocks are never prefix-indexed and are
        freed on exit. Don't generate while it is open.
        """
        return self.engine.open_sequence(prompt_len=prompt_len)

    def close(self) -> None:
        """Close the KV stores (Redis connections, disk store handles) and the KV events publisher (its queued
        batches are sent first); generation must not follow."""
        if self.engine.kv_events is not None:
            self.engine.kv_events.close()
            self.engine.kv_events = None
        if self._built.tier_worker is not None:
            self._built.tier_worker.close()  # copies still in flight land first
        if self._built.connector is not None:
            self._built.connector.close()

    def reset_prefix_cache(self) -> int:
        """Evict every cached, unreferenced device block (vLLM's ``reset_prefix_cache``); returns how many.

        Tiers keep their copies (a ``write_back`` host tier receives the evicted blocks first).
        """
        return self.engine.reset_prefix_cache()

    def reset_kv_cache(self) -> None:
        """Free the whole KV pool and allocate it afresh (vLLM's ``sleep()`` + ``wake_up()`` of the KV cache).

        Empties the prefix cache and every group's side pools, then re-allocates every layer's
        tensors from the same spec; calibrated static scales live in the spec, so they are kept
        (vLLM issue 25800, case C12).

        Raises:
            RuntimeError: requests are still running or waiting.
        """
        self.engine.reset_kv_cache()

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The text and token ids of a prompt: a text encoded as the model's tokenizer asks (BOS first where its
        configuration adds one: :func:`~kvpage.model.encode.encode_text`), or a ``{"prompt_token_ids": ...}``
        dict's ids as given.

        Raises:
            TypeError: neither a str nor a dict.
            ValueError: a dict without ``prompt_token_ids``, with an empty list, non-integer ids or ids outside
                the vocabulary, with unknown keys; a text with a lone surrogate (``"\ud800"``).
        """
        text, ids = check_prompt(prompt, self.config.vocab_size)
        if ids is None:
            assert text is not None  # (a text prompt)
            ids = encode_text(self.tokenizer, text)
        return text, ids

    def chat_prompt(self, messages: str | Sequence[dict[str, str]]) -> dict[str, Any]:
        """Apply the tokenizer's chat template (with the generation prompt) to a message list or a single user message.

        Raises:
            TypeError: ``messages`` is neither a str nor a list of dicts.
            ValueError: an empty list; a message whose ``role`` or ``content`` is not a str (named as
                ``messages[i].content``); no non-blank user message; no chat template.
        """
        from kvpage.model.loader import apply_chat_template

        ids = apply_chat_template(self.tokenizer, check_messages(messages))
        return {"prompt": self.tokenizer.decode(ids), "prompt_token_ids": ids}

    # -- generation ----------------------------------------------------------------------------
    def chat(
        self,
        messages: str | Sequence[dict[str, str]] | Sequence[str | Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate answers to one conversation or a list of them (each a message list or a user string).

        Raises:
            TypeError: ``messages`` is not a str or a list; ``sampling_params`` of the wrong type.
            ValueError: an empty list, or a bad conversation (see :meth:`chat_prompt`); nothing is queued then.
        """
        if not isinstance(messages, (str, list, tuple)):
            raise TypeError(f"messages must be a str, a list of message dicts or a list of conversations, "
                            f"got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages is empty: give a conversation (a list of {'role', 'content'} dicts) or a str")
        if isinstance(messages, str) or isinstance(messages[0], dict):
            convs: list[Any] = [messages]
        else:
            convs = list(messages)
        return self.generate([self.chat_prompt(c) for c in convs], sampling_params)

    def _add(self, prompts: PromptType | Sequence[PromptType],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        """Check and queue every prompt, or none: any bad prompt or params raises before the first is queued; an
        error of one prompt of a list of several is prefixed ``prompts[i]: `` (the caller's index)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a {{'prompt_token_ids': [...]}} dict or a list of them, "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
            bad = next((i for i, p in enumerate(params_list) if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise TypeError(f"sampling_params[{bad}] must be a SamplingParams, got "
                                f"{type(params_list[bad]).__name__}")
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}; build one with SamplingParams(**fields)")

        def at(i: int, e: Exception) -> None:
            """Prefix ``e``'s message (in place) with the prompt's index when there are several."""
            if len(prompts) > 1:
                prefix_message(e, f"prompts[{i}]: ")

        encoded: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompts):
            try:
                text, ids = self.encode(p)
                if not ids:  # "" (a tokenizer that adds no BOS): said as the text it is, not as token ids
                    raise ValueError(f"empty prompt: the text {text!r} encodes to no tokens; give at least one")
            except (TypeError, ValueError) as e:
                at(i, e)
                raise
            encoded.append((text, ids))
        ids_out: list[str] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(encoded, params_list)):
                rid = uuid.uuid4().hex  # the caller's id (with n > 1 the engine's requests are its completions)
                try:
                    self.engine.add_request(text, ids, sp, request_id=rid)
                except (TypeError, ValueError, KVPageError) as e:
                    at(i, e)
                    raise
                ids_out.append(rid)
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
        Closing the iterator early aborts the requests still running. Streams and
        :meth:`generate` calls may interleave on one ``LLM``: a step run by one
        delivers the others' outputs to their own queues, so none is lost.
        """
        ids = self._add(prompts, sampling_params)
        pending = set(ids)
        queue = self._router.open(ids)
        try:
            while pending:
                out = self._router.next_output(queue, pending)
                if out.finished:
                    pending.discard(out.request_id)
                yield out
        finally:
            self._router.close(ids)

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
            One finished :class:`RequestOutput` per prompt. A request that failed on its own (its forward
            pass, sampling or detokenization raised) has ``finish_reason == "error"`` and the message in
            ``outputs[0].error``; the others are unaffected.

        Raises:
            TypeError: ``prompts`` or ``sampling_params`` of the wrong type (``None``, a dict for params, ...).
            PromptTooLongError: a prompt reaches the context, prompt + ``max_tokens`` exceeds it (refused, not cut),
                or they cannot fit in the whole cache.
            ValueError: empty prompt, a malformed token prompt, or a params list of the wrong length.
            RequestLostError: a request was finished behind this call's back (``llm.engine.abort_request``).
            Nothing is queued when a prompt or params check fails, whichever prompt of the list it is.
        """
        final: dict[str, RequestOutput] = {}
        ids = self._add(prompts, sampling_params)
        pending = set(ids)
        queue = self._router.open(ids)
        try:
            while pending:
                out = self._router.next_output(queue, pending)
                if out.finished:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        finally:
            self._router.close(ids)
        return [final[i] for i in ids]
