"""``null`` is the default for every optional request field, as OpenAI's API documents them (issue 29, item 6).

OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` mark every optional parameter
(``temperature``, ``top_p``, ``n``, ``stream``, penalties, ``logprobs``, ...) as nullable, and clients
send ``"temperature": null`` to mean "the default". :class:`NullMeansDefault` gives a request model
exactly that: before validation, a JSON ``null`` in a field that has a default is dropped, so the
field takes its default and the model's attributes keep their plain types (``temperature`` is always
a float). Required fields (``model``, ``prompt``, ``messages``) are untouched: ``null`` there is a
400 naming the field. The JSON schema (``/openapi.json``) says the same: every optional property
admits ``null``.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema


def _admit_null(prop: dict[str, Any]) -> None:
    """Make one property's JSON schema accept ``null`` too (in place); a no-op where it already does."""
    if prop.get("type") == "null" or any(alt.get("type") == "null" for alt in prop.get("anyOf", [])):
        return
    t = prop.get("type")
    if isinstance(t, list):
        if "null" not in t:
            t.append("null")
        return
    if isinstance(t, str) and "const" not in prop and "enum" not in prop:
        prop["type"] = [t, "null"]          # keeps minimum/maximum/items at the top, where readers look
        return
    if "anyOf" in prop:
        prop["anyOf"].append({"type": "null"})
        return
    meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
    inner = dict(prop)
    prop.clear()
    prop.update({"anyOf": [inner, {"type": "null"}], **meta})


class NullMeansDefault(BaseModel):
    """A request model in which ``null`` for any field with a default means that default.

    Side effect at validation: the input dict is copied without those ``null`` entries (the caller's dict
    is not changed).
    """

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required())}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The model's schema with ``null`` admitted by every optional property."""
        json_schema = handler(core_schema)
        target = handler.resolve_ref_schema(json_schema)
        for name, prop in target.get("properties", {}).items():
            field = cls.model_fields.get(name)
            if field is not None and not field.is_required():
                _admit_null(prop)
        return json_schema
