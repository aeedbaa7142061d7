"""``LLM``: load a model, build its paged KV cache from a :class:`~kvpage.spec.CacheSpec`, and generate.

The API mirrors vLLM's offline ``LLM``: ``LLM(model, kv_cache_dtype=...,
block_size=..., kv_cache_memory_bytes=...)`` then ``generate(prompts,
SamplingParams(...))`` or ``chat(messages, ...)``.

Batching here is *static*: requests are admitted in waves whose whole
prompt + ``max_tokens`` fits in the free blocks, each wave is prefilled in one
forward pass (prompts concatenated, varlen) and decoded together, one forward
per step, until every request in it finishes. Blocks are reserved at admission,
so a running request can never run out of cache.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from kvpage.cache.block_pool import BlockManager, BlockTable
from kvpage.cache.controller import CacheController
from kvpage.errors import PromptTooLongError
from kvpage.engine.model_runner import ModelRunner, ScheduledRequest
from kvpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpage.engine.sampling import SamplingParams, sample
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


@dataclass
class _Request:
    """Engine-side state of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    max_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class LLM:
    """A model served on a paged KV cache.

    Args:
        model: path to a ``.gguf`` file or a Hugging Face folder (config.json +
            safetensors); ``None`` loads the bundled SmolLM2-135M-Instruct GGUF;
            a :class:`~kvpage.model.loader.LoadedModel` is used as is (several
            engines can share one set of weights; its dtype must match ``dtype``).
        kv_cache_dtype: KV format name or alias (see :mod:`kvpage.formats`).
        block_size: tokens per block.
        kv_cache_memory_bytes: KV budget in bytes (vLLM's ``kv_cache_memory_bytes``);
            the block count is the largest that fits, scales included.
        num_blocks: exact block count (overrides the budget; vLLM's ``num_gpu_blocks_override``).
        dtype: compute dtype of the model: ``auto`` (float32), ``float32``, ``bfloat16``, ``float16``.
        max_model_len: longest sequence (prompt + output) in tokens; default the model's context.
        num_threads: torch CPU threads; ``None`` leaves torch's setting.
        device: ``"cpu"`` or ``"cuda"``.
        progress: show a progress bar while loading the model.

    Raises:
        ModelNotFoundError: the model path does not exist (or the bundled model is not installed).
        UnknownKVFormatError: unknown ``kv_cache_dtype``.
        ValueError: bad sizes or dtype.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        num_blocks: int | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        num_threads: int | None = None,
        device: str = "cpu",
        progress: bool = True,
    ) -> None:
        from kvpage.model.loader import LoadedModel, load_model

        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        # Build the spec first: an unknown kv_cache_dtype fails before the model loads.
        self._spec_args = dict(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=1, model_dtype=self.dtype, **self._spec_args)
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
            **self._spec_args,
        )
        self.controller = CacheController(self.spec, self.device)
        if num_blocks is None:
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_memory_bytes is None else int(kv_cache_memory_bytes)
            num_blocks = self.controller.num_blocks_for_budget(budget).num_blocks
            if num_blocks <= 0:
                raise ValueError(
                    f"kv_cache_memory_bytes={budget} holds no block of {self.spec.bytes_per_block} bytes; raise it"
                )
        self.num_blocks = int(num_blocks)
        caches = self.controller.initialize_kv_cache(self.num_blocks)
        self.block_manager = BlockManager(self.num_blocks, self.spec.block_size)
        self.runner = ModelRunner(self.model, self.spec, caches, self.device)
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        self.eos_token_ids = set(self.config.eos_token_ids)
        self._counter = 0

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

    def _new_request(self, prompt: PromptType, params: SamplingParams) -> _Request:
        text, ids = self.encode(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context (max_model_len) is {self.max_model_len}. "
                f"Shorten the prompt."
            )
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        need = self.block_manager.blocks_for(len(ids) + max_tokens)
        if need > self.num_blocks:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} needs {need} blocks of "
                f"{self.spec.block_size} tokens, but the KV cache holds only {self.num_blocks} blocks "
                f"({self.max_cache_tokens} tokens). Raise kv_cache_memory_bytes/num_blocks, pick a smaller "
                f"kv_cache_dtype, or lower max_tokens."
            )
        self._counter += 1
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(int(params.seed))
        return _Request(str(self._counter - 1), text, ids, params, time.perf_counter(), generator=gen,
                        max_tokens=max_tokens)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``, batched, in input order.

        Args:
            prompts: one prompt or a list (text, or ``{"prompt_token_ids": [...]}``).
            sampling_params: one for all, or one per prompt; default ``SamplingParams()``.

        Returns:
            One :class:`RequestOutput` per prompt.

        Raises:
            PromptTooLongError: a prompt exceeds the context or cannot fit in the whole cache.
            ValueError: empty prompt, or a params list of the wrong length.
        """
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
        requests = [self._new_request(p, sp) for p, sp in zip(prompts, params_list)]
        pending = list(requests)
        while pending:
            wave: list[_Request] = []
            free = self.block_manager.pool.num_free
            while pending and self.block_manager.blocks_for(len(pending[0].prompt_token_ids) + pending[0].max_tokens) <= free:
                r = pending.pop(0)
                free -= self.block_manager.blocks_for(len(r.prompt_token_ids) + r.max_tokens)
                wave.append(r)
            self._run_wave(wave)
        return [self._output(r) for r in requests]

    def _run_wave(self, wave: list[_Request]) -> None:
        tables: dict[str, BlockTable] = {}
        try:
            for r in wave:
                tables[r.request_id] = self.block_manager.allocate(r.request_id, len(r.prompt_token_ids) + r.max_tokens)
            batch = [ScheduledRequest(r.prompt_token_ids, 0, tables[r.request_id].block_ids) for r in wave]
            logits = self.runner.execute(batch)
            active = list(wave)
            for r, row in zip(wave, logits):
                self._append_token(r, sample(row, r.params, r.generator))
            active = [r for r in active if r.finish_reason is None]
            while active:
                batch = [
                    ScheduledRequest([r.output_token_ids[-1]], r.num_tokens - 1, tables[r.request_id].block_ids)
                    for r in active
                ]
                logits = self.runner.execute(batch)
                for r, row in zip(active, logits):
                    self._append_token(r, sample(row, r.params, r.generator))
                active = [r for r in active if r.finish_reason is None]
        finally:
            for r in wave:
                self.block_manager.free(r.request_id)

    def _append_token(self, r: _Request, token: int) -> None:
        now = time.perf_counter()
        if r.first_token_time is None:
            r.first_token_time = now
        r.output_token_ids.append(token)
        p = r.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            r.finish_reason = "stop"
        text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        for s in p.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
                r.finish_reason = "stop"
        r.text = text
        if r.finish_reason is None and len(r.output_token_ids) >= r.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            r.finish_time = now

    def _output(self, r: _Request) -> RequestOutput:
        metrics = RequestMetrics(
            prompt_tokens=len(r.prompt_token_ids),
            output_tokens=len(r.output_token_ids),
            time_to_first_token_s=None if r.first_token_time is None else r.first_token_time - r.arrival,
            total_time_s=None if r.finish_time is None else r.finish_time - r.arrival,
        )
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            outputs=[CompletionOutput(0, r.text, list(r.output_token_ids), r.finish_reason)],
            finished=r.finish_reason is not None,
            metrics=metrics,
        )
