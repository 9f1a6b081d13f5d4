"""What one request's output constraint may cost (no torch): a grammar's and a regex's
length (`protocol`'s fields), and a JSON schema's size and width, checked before the
metaschema check and before any grammar is compiled, by the router and the worker
(`tools.check_json_schema`).

A schema's cost grows with its size (the metaschema check, the grammar's conversion and
compilation) and, at generation time, with the width of its objects: the grammar engine
keeps ~4 parser items per optional property of an object it is inside, and refuses a row of
more than 10,000 (`engine.structured.llguidance_backend.LIMITS`), so a schema of 2,600
optional properties would compile and then fail at its first key. Each bound is named in
the 400.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_GRAMMAR_CHARS = 128 << 10  # guided_grammar: compiling one this long takes ~0.3 s
MAX_REGEX_CHARS = 16 << 10  # guided_regex
MAX_SCHEMA_NODES = 10_000  # objects, arrays and scalars, each key's value and item counted
MAX_SCHEMA_TEXT = 1 << 20  # characters of its keys and strings together
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in one another
MAX_OPTIONAL_PROPERTIES = 2000  # properties of one object schema not in its `required`


class SchemaTooLarge(ValueError):
    """A schema past one of the bounds; the message names the bound and its value."""


@dataclass
class _Walk:
    nodes: int = 0
    text: int = 0


def check_schema_size(schema: object) -> None:
    """Raises SchemaTooLarge when `schema` (parsed JSON) exceeds a bound. Stops at the
    first bound exceeded, so its cost is bounded by the bounds, not by the schema."""
    _visit(schema, 1, _Walk())


def _visit(node: object, depth: int, walk: _Walk) -> None:
    walk.nodes += 1
    if walk.nodes > MAX_SCHEMA_NODES:
        raise SchemaTooLarge(f"the schema has more than {MAX_SCHEMA_NODES} values (objects, "
                             "arrays, strings and numbers); a schema may have at most "
                             f"{MAX_SCHEMA_NODES}")
    if isinstance(node, str):
        _add_text(walk, len(node))
        return
    if not isinstance(node, dict | list):
        return
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaTooLarge(f"the schema nests objects and arrays more than "
                             f"{MAX_SCHEMA_DEPTH} deep; at most {MAX_SCHEMA_DEPTH} are allowed")
    if isinstance(node, list):
        for item in node:
            _visit(item, depth + 1, walk)
        return
    _check_width(node)
    for key, value in node.items():
        _add_text(walk, len(key))
        _visit(value, depth + 1, walk)


def _add_text(walk: _Walk, chars: int) -> None:
    walk.text += chars
    if walk.text > MAX_SCHEMA_TEXT:
        raise SchemaTooLarge(f"the schema's keys and strings exceed {MAX_SCHEMA_TEXT} "
                             "characters together; that is the most a schema may have")


def _check_width(node: dict[object, object]) -> None:
    """An object schema's optional properties, against the grammar engine's row limit."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or len(properties) <= MAX_OPTIONAL_PROPERTIES:
        return
    required = node.get("required")
    names = ({r for r in required if isinstance(r, str)} & properties.keys()
             if isinstance(required, list) else set())
    optional = len(properties) - len(names)
    if optional > MAX_OPTIONAL_PROPERTIES:
        raise SchemaTooLarge(f"an object schema has {optional} optional properties; at most "
                             f"{MAX_OPTIONAL_PROPERTIES} are allowed (list the others in "
                             "its `required`, or split the object)")
