"""Known OpenAI request fields this server cannot honour, accepted only at their "off" value.

Any other value is a 400 naming the field ("... is not supported"),
so that a client never silently gets something other than what it asked for;
a value of the wrong type is a 400 like any strict field:

==============================================  ======================================================
field                                           accepted ("off") values
==============================================  ======================================================
``presence_penalty``, ``frequency_penalty``     0 (a number in [-2, 2] otherwise: 400 not supported)
``logit_bias``                                  null or ``{}`` (an object of numbers otherwise)
``response_format``                             null or ``{"type": "text"}``
``logprobs`` (completions), ``best_of``, ...    ``logprobs`` null; ``best_of`` null or 1; ``suffix``
                                                null or ``""``
``logprobs`` (chat), ``top_logprobs``           ``logprobs`` null or false; ``top_logprobs`` null or 0
``tools``, ``functions``                        null or ``[]``
``tool_choice``, ``function_call``              null or ``"none"``
==============================================  ======================================================

``null`` is each field's default, as for every optional field (:mod:`kvpage.server.nullable`): a null
penalty is 0. The request models of :mod:`kvpage.server.protocol` inherit these mixins.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from kvpage.server.nullable import NullMeansDefault

_STRICT = ConfigDict(extra="ignore", strict=True)


def integral(v: Any) -> Any:
    """``5.0`` -> ``5`` (JSON Schema's "integer" includes integral floats); ``1.5``, ``true``, ``"5"`` pass through
    unchanged for the strict check to reject."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _unsupported(v: Any, why: str) -> ValueError:
    """The error of a known OpenAI field given a value this server cannot honour (``v`` quoted as JSON)."""
    shown = json.dumps(v, ensure_ascii=False)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ValueError(f"{shown} is not supported: {why}")


def _schema_only(description: str, *accepted: dict[str, Any], nullable: bool = True) -> dict[str, Any]:
    """``Field`` keywords whose JSON schema lists exactly the accepted values (``accepted``, and null if ``nullable``).

    So schema-driven clients and fuzzers (schemathesis) see what the server takes;
    the validators below still check every value (wrong types included).
    """
    alternatives = [*accepted, {"type": "null"}] if nullable else list(accepted)

    def schema(s: dict[str, Any]) -> None:
        s.clear()
        s.update({"description": description, **({"anyOf": alternatives} if len(alternatives) > 1
                                                  else alternatives[0])})

    return {"description": description, "json_schema_extra": schema}


def _only(description: str, *accepted: dict[str, Any]) -> Any:
    """A ``Field`` defaulting to ``None`` (off) whose schema is :func:`_schema_only`'s."""
    return Field(None, **_schema_only(description, *accepted))


class ResponseFormat(BaseModel):
    """``response_format``: only ``{"type": "text"}`` (plain text) is served; JSON modes are rejected."""

    model_config = _STRICT

    type: str


Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False, **_schema_only(
    "Only 0: this server applies no presence or frequency penalty.", {"type": "number", "const": 0}, nullable=False))]


class OffCommon(NullMeansDefault):
    """Both endpoints: penalties, ``logit_bias``, ``response_format``."""

    model_config = _STRICT

    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = _only(
        "Only null or {}: no logit bias is applied.", {"type": "object", "maxProperties": 0})
    response_format: ResponseFormat | None = _only(
        'Only null or {"type": "text"}: plain text.',
        {"type": "object", "properties": {"type": {"type": "string", "const": "text"}}, "required": ["type"]})

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise _unsupported(v, "this server applies no presence or frequency penalty (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise _unsupported(v, "this server applies no logit bias (only null or {})")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type != "text":
            raise _unsupported(v.model_dump(), 'this server produces plain text only (null or {"type": "text"})')
        return v


class OffCompletion(NullMeansDefault):
    """``/v1/completions``: ``logprobs``, ``best_of``, ``suffix``."""

    model_config = _STRICT

    logprobs: Annotated[int, BeforeValidator(integral)] | None = _only(
        "Only null: this server returns no log-probabilities.")
    best_of: Annotated[int, BeforeValidator(integral)] | None = _only(
        "Only null or 1: one sequence is generated per request.", {"type": "integer", "const": 1})
    suffix: str | None = _only(
        'Only null or "": insertion is not supported.', {"type": "string", "maxLength": 0})

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise _unsupported(v, "this server returns no log-probabilities (only null)")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _unsupported(v, "this server generates one sequence per request (only null or 1)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported(v, 'this server does not insert text before a suffix (only null or "")')
        return v



class OffChat(NullMeansDefault):
    """``/v1/chat/completions``: ``logprobs``, ``top_logprobs``, tools and functions."""

    model_config = _STRICT

    logprobs: bool | None = _only(
        "Only null or false: this server returns no log-probabilities.", {"type": "boolean", "const": False})
    top_logprobs: Annotated[int, BeforeValidator(integral)] | None = _only(
        "Only null or 0: this server returns no log-probabilities.", {"type": "integer", "const": 0})
    tools: list[dict[str, Any]] | None = _only(
        "Only null or []: tool calls are not supported.", {"type": "array", "maxItems": 0})
    functions: list[dict[str, Any]] | None = _only(
        "Only null or []: function calls are not supported.", {"type": "array", "maxItems": 0})
    tool_choice: Union[str, dict[str, Any], None] = _only(
        'Only null or "none": tools and functions are not supported.', {"type": "string", "const": "none"})
    function_call: Union[str, dict[str, Any], None] = _only(
        'Only null or "none": tools and functions are not supported.', {"type": "string", "const": "none"})

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported(v, "this server returns no log-probabilities (only null or false)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise _unsupported(v, "this server returns no log-probabilities (only null or 0)")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise _unsupported(v, "this server does not call tools or functions (only null or [])")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is not None and v != "none":
            raise _unsupported(v, 'this server does not call tools or functions (only null or "none")')
        return v
