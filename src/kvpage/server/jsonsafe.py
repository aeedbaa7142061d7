"""JSON that always encodes as UTF-8: every body the server sends (responses, SSE events) goes through :func:`dumps`.

A JSON request may carry a lone surrogate (``"\\ud800"``): Python decodes it into a
``str`` that UTF-8 cannot encode, so echoing it (an error message that quotes the
bad value, the unknown model's name) made Starlette's ``JSONResponse`` raise
``UnicodeEncodeError`` (a 500, or a reset connection when it happened inside an
exception handler). Here each lone surrogate in a string is written as the six
visible characters ``\\ud800`` instead, so the body is valid UTF-8 that every JSON
parser accepts (strict ones reject an escaped lone surrogate) and the client sees
which value was meant.
"""
from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

_SURROGATE = re.compile("[\ud800-\udfff]")


def scrub(value: Any) -> Any:
    """``value`` with each lone surrogate of every string in it (keys too) replaced by its ``\\uXXXX`` text.

    Args:
        value: a JSON-able value (dicts, lists, tuples, strings, numbers, ``None``).

    Returns:
        The same structure (new containers where something changed); other values unchanged.
    """
    if isinstance(value, str):
        return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """``value`` as compact JSON text (non-ASCII kept as is) that is guaranteed to encode as UTF-8.

    Lone surrogates are scrubbed (:func:`scrub`) only when there are any, so the
    common case costs one ``json.dumps`` and one encode check.

    Raises:
        TypeError: ``value`` is not JSON-able. ``ValueError``: it holds a NaN or infinity.
    """
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    if _SURROGATE.search(text) is None:
        return text
    return json.dumps(scrub(value), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def model_json(model: Any) -> str:
    """A pydantic model as JSON text via :func:`dumps` (its ``model_dump(mode="json")``)."""
    return dumps(model.model_dump(mode="json"))


class SafeJSONResponse(JSONResponse):
    """Starlette's ``JSONResponse`` rendered with :func:`dumps`: never fails on a lone surrogate.

    The app's default response class and the class of every error body.
    """

    def render(self, content: Any) -> bytes:
        """``content`` as UTF-8 JSON bytes."""
        return dumps(content).encode("utf-8")
