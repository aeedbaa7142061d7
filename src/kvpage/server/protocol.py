"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks and error bodies.

Requests follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``
(plus vLLM's ``top_k``, ``ignore_eos`` and ``stop_token_ids`` extensions).
Unknown fields are ignored, as OpenAI and vLLM do; a known field of the wrong
type fails validation. Range rules (``max_tokens >= 1``, ``0 <= temperature <= 2``,
``0 < top_p <= 1``, ``n == 1``) are validators here, so one place states them;
:mod:`kvpage.server.app` turns their failures into OpenAI-style error bodies.

Responses carry ``usage`` with ``prompt_tokens_details.cached_tokens`` (prompt
tokens served from the prefix cache), as OpenAI's API does.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from kvpage.engine.sampling import SamplingParams

#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's); chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage block."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both generation endpoints (sampling, streaming, vLLM extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {v}")
        return v

    def requested_max_tokens(self) -> int | None:
        """The output-token limit the client asked for, or ``None`` for the endpoint's default."""
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request.

        Args:
            default_max_tokens: used when the client gave no limit (the engine
                caps it further at the model's context).
        """
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt as text or token ids (one prompt per request).

    A one-element list (``["text"]`` or ``[[ids...]]``) is accepted as that prompt,
    since the ``openai`` client may wrap it so.
    """

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"give one prompt per request (n == 1), got a list of {len(v)} prompts")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt is empty: give at least one token")
        if isinstance(v, list) and not v:
            raise ValueError("prompt is an empty token list: give at least one token")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v


class ContentPart(BaseModel):
    """A text content part; other part types (images, audio) are rejected by validation."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template.

    ``max_completion_tokens`` (the newer OpenAI name) wins over ``max_tokens``.
    Without either, the answer may run to the end of the model's context.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_completion_tokens must be at least 1, got {v}")
        return v

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them (``developer`` is rendered as ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# -- responses ---------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: prompt tokens whose KV came from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one request (``completion_tokens`` includes a stop token, as in vLLM)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def build(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """Usage from the counts: ``total = prompt + completion``; cached tokens are part of the prompt tokens."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def _now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    """One choice of a completion (or a completion stream chunk, where ``text`` is the delta)."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion, and (``object`` aside) of each stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    """The answer of a non-streamed chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """The body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """The new part of a streamed chat answer (``role`` only in the first chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvpage"
    max_model_len: int


class ModelList(BaseModel):
    """The body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error object: a message for people, a type and code for programs."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``, the body of every non-2xx response (and of an SSE error event)."""

    error: ErrorInfo
