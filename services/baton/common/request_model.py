"""How every OpenAI request model parses (`common.protocol`, `common.tools`): strict types, no
unknown fields, no NaN / Infinity (a non-finite float is a 400) — and a JSON `null` means
"not set", as OpenAI's spec has it for every optional field (the SDK sends `n=None`,
`stream=None` as null).

A null for a field that takes None keeps it; for any other field — one with a default, or
one Baton does not implement (`store`, `metadata`, `service_tier`, ...) — it is left out, as
if not sent; a required field stays required. A value that is set for a field Baton does
not implement is still a 400 that names it. A model may also list OpenAI response fields a
client replays into its next request (`_EMPTY_IS_UNSET`: a message's `refusal`,
`annotations`, ...): empty, they are left out the same way."""

from __future__ import annotations

import types
from typing import Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_EMPTY: tuple[object, ...] = (None, "", [], {})


class RequestModel(BaseModel):
    model_config = STRICT
    _EMPTY_IS_UNSET: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = _fields_by_name(cls)
        unset = [key for key, value in data.items() if _unset(cls, fields, key, value)]
        if not unset:
            return data
        return {k: v for k, v in data.items() if k not in unset}


def _unset(cls: type[RequestModel], fields: dict[str, FieldInfo], key: str,
           value: object) -> bool:
    field = fields.get(key)
    if value is None:
        return field is None or not _takes_none(field)
    return field is None and key in cls._EMPTY_IS_UNSET and value in _EMPTY


def _fields_by_name(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    """The fields by the names a body uses (an alias where a field has one)."""
    return {info.alias or name: info for name, info in cls.model_fields.items()}


def _takes_none(field: FieldInfo) -> bool:
    annotation = field.annotation
    if annotation is None or annotation is type(None):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return type(None) in get_args(annotation)
    return False
