"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks and error bodies.

Requests follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``
(plus vLLM's ``top_k``, ``ignore_eos`` and ``stop_token_ids`` extensions).
Request models are *strict*, as OpenAI is: ``"max_tokens": "5"``,
``"stream": "yes"``, ``true`` for an integer or ``1.5`` for an integer are
rejected; an integer is accepted where a number is (``"temperature": 1``) and
an integral number where an integer is (``5.0``: JSON Schema's "integer").
Unknown fields are ignored, as OpenAI and vLLM do. ``null`` in any optional field is its default
(OpenAI documents them all as nullable; :mod:`kvpage.server.nullable`): ``"temperature": null`` is 1,
``"n": null`` is 1, ``"stream": null`` is false; ``null`` in a required field (``model``, ``prompt``,
``messages``) is a 400.

Every range rule is a constraint here, so the OpenAPI schema states it and one
place checks it (the defaults, which ``null`` also selects, in brackets):

==========================  =================================================================
field                       accepted
==========================  =================================================================
``model``                   string (the served name, else 404)
``max_tokens``              integer >= 1 [16; chat: the rest of the context] (prompt +
                            max_tokens must fit the context: checked in :mod:`kvpage.server.app`,
                            which knows the prompt's length)
``max_completion_tokens``   integer >= 1 (chat; wins over ``max_tokens``)
``temperature``             number in [0, 2] [1]
``top_p``                   number in (0, 1] [1]
``top_k``                   integer >= -1 (-1 and 0 disable it) [-1]
``seed``                    integer in the int64 range [none: unseeded]
``stop``                    string or array of at most 4 strings, each non-empty [none]
``stop_token_ids``          array of integers >= 0 (ids beyond the vocabulary: 400 in the app)
                            [``[]``]
``ignore_eos``, ``stream``  boolean [false]
``n``                       integer in [1, 128]: choices per request [1]
``stream_options``          object ``{"include_usage": boolean}``, only with ``stream: true`` [none]
``prompt``                  non-empty string, non-empty array of token ids >= 0, or an
                            array of 1 to 128 of either (one prompt each; not mixed); prompts x
                            ``n`` at most 128 choices (checked in :mod:`kvpage.server.app`)
``echo``                    false [false]
``messages``                non-empty array of ``{"role", "content"}``; role ``system``,
                            ``developer``, ``user`` or ``assistant``; content a string or an
                            array of ``{"type": "text", "text"}`` parts (null only for ``assistant``)
``kv_transfer_params``      object (vLLM's disaggregated-prefill field): ``do_remote_decode`` and
                            ``do_remote_prefill`` booleans [false]; other keys (``remote_engine_id``,
                            ``remote_block_ids``, ...) are accepted and ignored; needs a server
                            started with ``--kv-transfer-config`` (else 400, in :mod:`kvpage.server.app`)
==========================  =================================================================

Known OpenAI fields this server cannot honour (penalties, ``logprobs``, tools, ...)
are accepted only at their "off" value: :mod:`kvpage.server.unsupported`.

:mod:`kvpage.server.errors` turns validation failures into 400 OpenAI-style
error bodies whose ``param`` names the field.

Responses carry ``usage`` with ``prompt_tokens_details.cached_tokens`` (prompt
tokens served from the prefix cache), as OpenAI's API does.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from kvpage.engine.sampling import MAX_N, SamplingParams
from kvpage.engine.validate import ChatRole
from kvpage.server.nullable import NullMeansDefault
from kvpage.server.unsupported import OffChat, OffCommon, OffCompletion, integral

#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's); chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Most stop strings one request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4
#: Most prompts one ``/v1/completions`` request may give as an array (each gets ``n`` choices).
MAX_PROMPTS = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_STRICT = ConfigDict(extra="ignore", strict=True)


# Integer fields: strict (no bools, no strings), but ``5.0`` counts as 5. The constraints come before the
# validator so that the JSON schema states them as ``minimum``/``maximum``.
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(integral)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(integral)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(integral)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), BeforeValidator(integral)]
Choices = Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(integral)]
StopString = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class StreamOptions(NullMeansDefault):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage block."""

    model_config = _STRICT

    include_usage: bool = False


class KVTransferParams(NullMeansDefault):
    """``kv_transfer_params`` of vLLM's disaggregated-prefill proxy: a prefill request carries
    ``do_remote_decode: true`` (its blocks go to the store before it answers); the answer carries
    ``do_remote_prefill: true``, which the proxy hands the decode request. kvpage's store needs no remote
    addresses: vLLM's ``remote_*`` keys are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    do_remote_decode: bool = False
    do_remote_prefill: bool = False


class _Request(OffCommon):
    """Fields shared by both generation endpoints (sampling, streaming, vLLM extensions); strict types."""

    model_config = _STRICT

    model: str
    max_tokens: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: TopK = -1
    seed: Seed | None = None
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    n: Choices = Field(1, description=f"Choices to generate for the prompt (1 to {MAX_N}); they share the prompt's "
                                      f"KV blocks; with a seed each choice samples reproducibly and differently.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: KVTransferParams | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return v

    def requested_max_tokens(self) -> int | None:
        """The output-token limit the client asked for, or ``None`` for the endpoint's default."""
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The name of the field that set :meth:`requested_max_tokens` (for error bodies)."""
        return "max_tokens"

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request.

        Args:
            default_max_tokens: used when the client gave no limit.

        Raises:
            ValueError: from :class:`SamplingParams` (a rule stated there but not here).
        """
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            n=self.n,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request, OffCompletion):
    """``POST /v1/completions``: one prompt (text or token ids) or an array of prompts, as OpenAI takes them.

    An array of strings or of token-id arrays is that many prompts (:meth:`prompts`); the response
    has ``n`` choices per prompt, prompt ``i``'s ``j``-th at ``index`` ``i * n + j``.
    """

    prompt: Union[
        Annotated[str, Field(min_length=1)],
        TokenIds,
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
    ] = Field(description=f"Text, token ids, or an array of 1 to {MAX_PROMPTS} prompts (all strings or all "
                          f"token-id arrays); each prompt gets n choices, prompt i's j-th at index i * n + j; "
                          f"prompts x n at most {MAX_N}.")
    echo: bool = Field(False, json_schema_extra={"const": False}, description="Only false (echo is not supported).")

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: one for a string or a token-id array, one per item of an array of them."""
        p = self.prompt
        if isinstance(p, str) or not isinstance(p[0], (str, list)):
            return [p]  # type: ignore[list-item]  # a str, or one prompt of token ids
        return list(p)  # type: ignore[arg-type]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("true is not supported")
        return v


class ContentPart(BaseModel):
    """A text content part; other part types (images, audio) are rejected by validation."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts.

    ``content`` may be null (or missing) only for ``assistant`` messages.
    """

    model_config = _STRICT

    role: ChatRole  # the Python API's roles (kvpage.engine.validate)
    content: Union[str, list[ContentPart], None] = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v: str | list[ContentPart] | None,
                                  info: ValidationInfo) -> str | list[ContentPart] | None:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"required for a {role} message (null only for assistant)")
        return v

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request, OffChat):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template.

    ``max_completion_tokens`` (the newer OpenAI name) wins over ``max_tokens``.
    Without either, the answer may run to the end of the model's context.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """``max_completion_tokens`` when that set the limit, else ``max_tokens``."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as :meth:`LLM.chat_prompt <kvpage.engine.llm.LLM.chat_prompt>` takes them (its
        :func:`~kvpage.engine.validate.check_messages` renders ``developer`` as ``system``, for both APIs)."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


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
    kv_transfer_params: dict[str, Any] | None = None


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
    kv_transfer_params: dict[str, Any] | None = None


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
