"""Custom resources the chart renders (Prometheus Operator, KEDA, Gateway API and its
Inference Extension) against their CRDs' schemas, vendored in schemas/ (one file per
apiVersion and kind; each says where it comes from).

kubernetes-validate knows only the built-in kinds. An API server prunes fields a CRD does
not declare, and `kubectl apply` (strict field validation) refuses them, so an object schema
that declares properties here refuses any other field, as `kubernetes-validate --strict`
does for built-in kinds, unless it keeps unknown fields on purpose
(x-kubernetes-preserve-unknown-fields) or declares a map (additionalProperties).
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import jsonschema

SCHEMAS = Path(__file__).resolve().parent / "schemas"


def schema_file(api_version: str, kind: str) -> Path:
    return SCHEMAS / f"{api_version.replace('/', '_')}_{kind}.json"


def strict(schema):
    """A copy of `schema` in which every object with declared properties refuses others."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


@cache
def validator(api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
    path = schema_file(api_version, kind)
    if not path.is_file():
        return None
    schema = strict(json.loads(path.read_text()))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def has_schema(doc: dict) -> bool:
    return validator(doc["apiVersion"], doc["kind"]) is not None


def crd_problems(doc: dict) -> list[str]:
    """Each way `doc` breaks its CRD's schema, as "path: message" (none: valid)."""
    what = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    check = validator(doc["apiVersion"], doc["kind"])
    return [f"{what}: {'.'.join(str(p) for p in err.absolute_path)}: {err.message}"
            for err in sorted(check.iter_errors(doc), key=lambda e: list(e.absolute_path))]
