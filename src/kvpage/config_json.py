"""The fields of a vLLM-style JSON setting (``speculative_config``, ``kv_events_config``, ``kv_transfer_config``).

vLLM takes these settings as a dataclass, a dict of its fields, or that dict as a JSON string on the command line
(``--speculative-config '{...}'``); :func:`config_fields` is the one parser every such setting's ``coerce`` uses, so
that they fail alike, naming the setting. Torch-free, standard library only.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def config_fields(value: dict[str, Any] | str, name: str, known: Iterable[str]) -> dict[str, Any]:
    """The field dict of setting ``name`` given as a dict or a JSON object string.

    Args:
        value: a dict of fields, or its JSON text.
        name: the setting's name (``"kv_events_config"``), used in every message.
        known: the setting's field names.

    Returns:
        The dict (``value`` itself, or the parsed JSON object); its keys are all in ``known``.

    Raises:
        ValueError: bad JSON (``"<name> is not valid JSON: ..."``), not an object (``"<name> must be a dict"``), or
            unknown keys (listed, with the known ones).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (a JSON object), got {type(value).__name__}")
    names = list(known)
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {', '.join(sorted(names))}")
    return value
