"""Checks of what callers hand the engine, run before anything is queued; each error names the field.

The rule, the same at :meth:`~kvpage.engine.engine.LLMEngine.add_request` and the
:class:`~kvpage.engine.llm.LLM` API: an argument of the wrong Python type raises
``TypeError``; a value of the right container type that is malformed or out of
range (an entry of a token list, a message's ``role``, a lone surrogate in a
prompt) raises ``ValueError``. :class:`~kvpage.engine.sampling.SamplingParams`
raises ``ValueError`` for every bad field, as vLLM's does. Nothing here touches
engine state.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Literal, SupportsIndex, get_args


def as_int(value: object) -> int | None:
    """``value`` as a plain int if it is integral, else ``None``.

    Integral: an int or anything ``operator.index`` takes (numpy integer scalars, a one-element
    integer tensor). Not integral: bools, floats (``5.0`` too), strings, float tensors.
    """
    if type(value) is int:  # the common case first: a protocol isinstance costs ~4 us, per token of a prompt
        return value
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:  # has __index__ but refuses: a float tensor, a tensor of several elements
        return None


def check_text(value: object, field: str, *, optional: bool = False) -> str | None:
    """``value`` if it is a str (or ``None`` when ``optional``) that encodes as UTF-8.

    Raises:
        TypeError: not a str (nor ``None`` when ``optional``).
        ValueError: a lone surrogate (``"\\ud800"``): no tokenizer can encode it.
    """
    if value is None and optional:
        return None
    if not isinstance(value, str):
        allowed = "a str or None" if optional else "a str"
        raise TypeError(f"{field} must be {allowed}, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode text: {value[e.start:e.end]!r} at index {e.start} is a "
                         f"lone surrogate, which UTF-8 cannot encode") from None
    return value


def check_token_ids(value: object, field: str, vocab_size: int | None, *, allow_empty: bool = False) -> list[int]:
    """``value`` as a list of token ids in ``[0, vocab_size)`` (no check of the upper end when ``vocab_size`` is None).

    Accepts a list, tuple or range of ints (numpy/torch integer scalars too: :func:`as_int`); bools, floats,
    float tensors and strings are not token ids.

    Raises:
        TypeError: not a list/tuple/range (a str, a dict, an int, ...).
        ValueError: an entry that is not an integer, one outside the vocabulary, or an empty list
            (unless ``allow_empty``).
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple, range)):
        raise TypeError(f"{field} must be a list of token ids (ints), got {type(value).__name__}")
    ids: list[int] = []
    for i, t in enumerate(value):
        tid = as_int(t)
        if tid is None:
            raise ValueError(f"{field}[{i}] must be an integer token id, got {t!r} ({type(t).__name__})")
        ids.append(tid)
    if not ids and not allow_empty:
        raise ValueError(f"empty prompt: {field} needs at least one token")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        where = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{field} {bad[:5]} are outside the vocabulary {where}")
    return ids


def check_prompt(prompt: object, vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    """Split an ``LLM`` prompt into ``(text, token ids or None)`` after checking its shape.

    A prompt is a str, or a dict with ``"prompt_token_ids"`` (a non-empty list of ids) and optionally
    ``"prompt"`` (its text, a str). Token ids of a text prompt are ``None`` here (the caller tokenizes).

    Raises:
        TypeError: neither a str nor a dict.
        ValueError: a dict without ``prompt_token_ids``, with bad ids, with unknown keys, or a ``prompt``
            that is not text; a str with a lone surrogate.
    """
    if isinstance(prompt, str):
        return check_text(prompt, "prompt"), None
    if not isinstance(prompt, Mapping):
        raise TypeError(f"a prompt is a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
    if "prompt_token_ids" not in prompt:
        raise ValueError(f"a dict prompt needs the key 'prompt_token_ids' (a list of token ids); got keys "
                         f"{sorted(map(str, prompt))}")
    unknown = sorted(str(k) for k in prompt if k not in ("prompt_token_ids", "prompt"))
    if unknown:
        raise ValueError(f"a dict prompt takes only 'prompt_token_ids' and 'prompt'; got unknown keys {unknown}")
    ids = check_token_ids(prompt["prompt_token_ids"], "prompt_token_ids", vocab_size)
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt (the text of a token prompt) must be a str or None, got {type(text).__name__}")
    return check_text(text, "prompt", optional=True), ids


#: The message roles a conversation may hold, the same for :meth:`LLM.chat <kvpage.engine.llm.LLM.chat>` and the
#: server's ``/v1/chat/completions`` (OpenAI's, without tool messages); ``developer`` is rendered as ``system``.
ChatRole = Literal["system", "developer", "user", "assistant"]
#: :data:`ChatRole`'s values, in order.
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


def _one_of(words: tuple[str, ...]) -> str:
    """``'a', 'b' or 'c'`` (as the server's error messages list a field's allowed values)."""
    quoted = [repr(w) for w in words]
    return ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def check_messages(messages: object) -> list[dict[str, Any]]:
    """A conversation as a list of ``{"role": str, "content": str}`` dicts (a str is one user message), with
    ``developer`` messages given the role ``system`` (as chat templates know it).

    Raises:
        TypeError: neither a str nor a list/tuple of dicts.
        ValueError: an empty list, a message that is not a dict, or whose ``role``/``content`` is missing or not
            text (names ``messages[i].role`` / ``messages[i].content``), a role not in :data:`CHAT_ROLES`, or no
            non-blank user message.
    """
    if isinstance(messages, str):
        check_text(messages, "messages")
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a str or a list of {{'role': ..., 'content': ...}} dicts, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': 'user', 'content': ...} message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "nothing" if key not in m else type(m[key]).__name__
                raise ValueError(f"messages[{i}].{key} must be a str, got {got}")
            check_text(m[key], f"messages[{i}].{key}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be {_one_of(CHAT_ROLES)}, got {m['role']!r}")
        out.append({**m, "role": "system" if m["role"] == "developer" else m["role"]})
    if not any(m["content"].strip() for m in out if m["role"] == "user"):
        raise ValueError("empty prompt: the conversation has no non-blank user message")
    return out
