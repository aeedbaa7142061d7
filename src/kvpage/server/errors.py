"""OpenAI-style error bodies for every failed request: ``{"error": {"message", "type", "param", "code"}}``.

* :class:`APIError` is raised by the routes and answered as its body and status;
* :func:`validation_error` turns FastAPI/pydantic validation failures (wrong
  types, values out of range, missing fields, malformed JSON, a body that is
  not a JSON object) into **one 400** whose message names every bad field and
  whose ``param`` is the first of them (``messages[0].role``), as OpenAI answers;
* :func:`install_error_handlers` routes those, the router's 404/405 and any
  unexpected exception (500, logged) through :class:`APIError`.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpage.server.jsonsafe import SafeJSONResponse
from kvpage.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

#: Status codes a generation route documents with an :class:`ErrorResponse` body (OpenAPI ``responses``).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (wrong type, out of range, too long)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    500: {"model": ErrorResponse, "description": "The engine failed on this request"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}

# pydantic error types meaning "the value is not of the member's type" (vs. a bad value of the right type)
_TYPE_ERRORS = frozenset({
    "int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type",
    "model_attributes_type", "none_required",
})

_MESSAGES = {
    "missing": "required",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected a boolean (true or false)",
    "string_type": "expected a string",
    "list_type": "expected an array",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} items",
    "string_too_short": "must not be empty",
    "literal_error": "must be {expected}",
    "finite_number": "must be a finite number",
    "string_unicode": "must be valid Unicode text (a lone surrogate such as \\ud800 is not)",
}

#: Why a field has the range it has, appended to its range errors.
_HINTS = {"n": "completions per prompt, 1 to 128 (they share the prompt's KV blocks)"}


class APIError(Exception):
    """An error answered with an OpenAI-style body.

    Args:
        status: HTTP status.
        message: what was wrong and what to do.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if one is.
        code: a machine-readable code (``model_not_found``, ``context_length_exceeded``).
        headers: extra response headers (``Allow`` on a 405).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        """The error as a JSON response (a :class:`SafeJSONResponse`: an echoed lone surrogate cannot break it)."""
        return SafeJSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                                headers=self.headers)


def _is_union_tag(x: object) -> bool:
    """Whether a pydantic ``loc`` element names a union member (``str``, ``list[constrained-int]``), not a field."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x
                                   or x.startswith(("constrained-", "function-")))


def _type_name(tag: str, plural: bool = False) -> str:
    """A union member's tag in words: ``list[list[constrained-int]]`` -> ``an array of arrays of integers``."""
    tag = tag.replace("constrained-", "")
    if tag.startswith("function-") and tag.endswith("]"):  # a validated type: function-before[f(), int]
        tag = tag[tag.index("[") + 1:-1].rsplit(", ", 1)[-1]
    if tag.startswith("list[") and tag.endswith("]"):
        return ("arrays of " if plural else "an array of ") + _type_name(tag[5:-1], plural=True)
    words = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
             "bool": ("a boolean", "booleans"),
             "ContentPart": ('a content part {"type": "text", "text": ...}', "text content parts")}
    one, many = words.get(tag, (f"a {tag} object", f"{tag} objects"))
    return many if plural else one


def _path(parts: Sequence[object]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _shown(value: Any) -> str:
    """A request value as JSON, cut to 60 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(e: dict[str, Any], path: str) -> str:
    """One pydantic error as ``field: what is wrong, got <value>``."""
    kind = e.get("type", "")
    ctx = e.get("ctx") or {}
    if kind in _MESSAGES:
        try:
            what = _MESSAGES[kind].format(**ctx)
        except (KeyError, IndexError):
            what = str(e.get("msg", "invalid"))
    else:
        what = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    field = path.rsplit(".", 1)[-1].split("[")[0]
    if field in _HINTS and kind in ("greater_than_equal", "less_than_equal"):
        what += f": {_HINTS[field]}"
    if kind in _TYPE_ERRORS or kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than",
                                        "too_short", "too_long", "literal_error", "finite_number",
                                        "string_unicode"):
        what += f", got {_shown(e.get('input'))}"
    return f"{path}: {what}" if path else what


def _pick_union_member(errs: list[tuple[list[object], int, dict[str, Any]]]) -> list[tuple[list[object], dict]]:
    """The errors to report for one union field: those of the member that came closest, or a type summary.

    ``errs`` holds ``(loc, tag index, error)``. A member whose errors are all type
    errors did not match at all; among the others, the one with the fewest errors wins.
    """
    by_member: dict[str, list[tuple[list[object], dict]]] = {}
    for loc, i, e in errs:
        by_member.setdefault(str(loc[i]), []).append((loc[:i] + loc[i + 1:], e))
    near = {m: es for m, es in by_member.items() if any(e.get("type") not in _TYPE_ERRORS for _, e in es)}
    if near:
        return min(near.values(), key=len)
    loc, i, e = errs[0]
    kinds = list(dict.fromkeys(_type_name(str(loc2[j])) for loc2, j, _ in errs))
    return [(loc[:i], {"type": "union_type", "msg": f"expected {' or '.join(kinds)}, got {_shown(e.get('input'))}"})]


def validation_error(exc: RequestValidationError) -> APIError:
    """One 400 OpenAI-style error for all of a request's validation errors.

    The message lists each bad field (``max_tokens: expected an integer, got "5"``);
    ``param`` is the first bad field's path. The members of a union field
    (``prompt``, ``stop``, ``content``) are merged: the member that came closest
    is reported, else "expected a string or an array of ...".
    """
    errors = [dict(e) for e in exc.errors()]
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        detail = (bad_json.get("ctx") or {}).get("error", "")
        where = [x for x in bad_json.get("loc", ()) if x != "body"]
        return APIError(400, f"malformed JSON body{f' at position {where[0]}' if where else ''}"
                             f"{f': {detail}' if detail else ''}")
    items: list[tuple[list[object], dict[str, Any]]] = []
    unions: dict[tuple, list[tuple[list[object], int, dict[str, Any]]]] = {}
    for e in errors:
        loc = list(e.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        tag = next((i for i, x in enumerate(loc) if _is_union_tag(x)), None)
        if tag is None:
            items.append((loc, e))
        else:
            site = tuple(loc[:tag])
            if site not in unions:
                items.append((list(site), {"type": "_union", "site": site}))
            unions.setdefault(site, []).append((loc, tag, e))
    parts: list[str] = []
    params: list[str] = []
    for loc, e in items:
        resolved = _pick_union_member(unions[e["site"]]) if e.get("type") == "_union" else [(loc, e)]
        for loc2, e2 in resolved:
            path = _path(loc2)
            if not path:
                kind = e2.get("type")
                text = ("the request body is missing: send a JSON object" if kind == "missing" else
                        f"the request body must be a JSON object, got {_shown(e2.get('input'))}"
                        if kind in _TYPE_ERRORS else _describe(e2, ""))
            else:
                text = _describe(e2, path)
                params.append(path)
            if text not in parts:
                parts.append(text)
    return APIError(400, "; ".join(parts) or "invalid request", param=params[0] if params else None)


def _body_error(err: BaseException) -> str:
    """Why a request body could not be read as JSON, from what FastAPI's body parser raised (it answers only "There
    was an error parsing the body" for anything but a JSON syntax error): bytes that are not UTF-8, or nesting past
    the parser's recursion limit."""
    if isinstance(err, UnicodeDecodeError):
        return f"the body is not UTF-8 text ({err.reason} at byte {err.start}); send JSON encoded as UTF-8"
    if isinstance(err, RecursionError):
        return "the JSON is nested too deeply to parse"
    return f"{type(err).__name__}: {err}"


def install_error_handlers(app: FastAPI) -> None:
    """Answer :class:`APIError`, validation errors, the router's 404/405 and unexpected exceptions OpenAI-style."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and content_type.split(";")[0].strip().lower() != "application/json":
            return APIError(400, f"the request body must be JSON: send it with Content-Type: application/json "
                                 f"(got {content_type or 'no Content-Type'})").response()
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"Invalid URL ({where}): no such route", "not_found"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"Method not allowed ({where}){f'; this route accepts {allowed}' if allowed else ''}"
            code = "method_not_allowed"
        elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "There was an error parsing the body"
            message, code = f"malformed request body ({where}): {_body_error(exc.__cause__)}", None
        else:
            message, code = f"{exc.detail} ({where})", None
        return APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()
