"""charts/baton/values.yaml against values.schema.json: the schema declares every value and
every declared value is in values.yaml, each value has a `# --` doc comment, the pod blocks
share one shape, and the schema is self-contained (helm resolves no remote `$ref`)."""

from __future__ import annotations

import json
import tomllib

import yaml

from tests.unit.deploy.kube import CHART, ROOT

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
# Kubernetes types and the tuning file: the schema lists their fields, values.yaml need not
# set them all (they are optional there too), and Kubernetes documents them.
OPTIONAL_FIELDS = {"#/$defs/resources", "#/$defs/affinity", "#/$defs/tuning",
                   "#/$defs/securityContext", "#/$defs/podSecurityContext", "#/$defs/strategy",
                   "#/$defs/labelSelector"}


def resolve(schema: dict) -> dict:
    while "$ref" in schema:
        node = SCHEMA
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def declared(schema: dict) -> dict | None:
    """The properties an object schema declares, or None for a free-form map."""
    return resolve(schema).get("properties")


def walk(value, schema: dict, path: str, problems: list[str], optional=False) -> None:
    props = declared(schema)
    if not isinstance(value, dict) or props is None:
        return
    optional = optional or schema.get("$ref") in OPTIONAL_FIELDS
    for key, sub in value.items():
        if key in props:
            walk(sub, props[key], f"{path}.{key}", problems, optional)
        elif resolve(schema).get("additionalProperties", True) is False:
            problems.append(f"{path}.{key} is in values.yaml but not in the schema")
    if not optional:
        problems += [f"{path}.{key} is in the schema but not in values.yaml"
                     for key in props if key not in value]


def test_schema_and_values_declare_the_same_keys():
    problems: list[str] = []
    walk(VALUES, SCHEMA, "", problems)
    assert problems == []


def test_values_yaml_passes_its_own_schema_types():
    def check(value, schema, path):
        schema = resolve(schema)
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types or []
        py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
              "integer": int, "number": (int, float)}
        if types:
            assert any(isinstance(value, py[t]) and not (t in ("integer", "number") and
                                                          isinstance(value, bool))
                       for t in types), f"{path}: {value!r} is not {types}"
        if "enum" in schema:
            assert value in schema["enum"], path
        for key, sub in (schema.get("properties") or {}).items():
            if isinstance(value, dict) and key in value:
                check(value[key], sub, f"{path}.{key}")
    check(VALUES, SCHEMA, "")


def test_every_declared_value_has_a_doc_comment():
    lines = VALUES_TEXT.splitlines()
    missing = []

    def visit(node, schema, path):
        props = declared(schema)
        if not isinstance(node, yaml.MappingNode) or props is None:
            return
        for key_node, value_node in node.value:
            row = key_node.start_mark.line - 1
            comment = []
            while row >= 0 and lines[row].strip().startswith("#"):
                comment.append(lines[row].strip())
                row -= 1
            if not any(c.startswith("# --") for c in comment):
                missing.append(f"{path}.{key_node.value} (line {key_node.start_mark.line + 1})")
            if key_node.value in props and props[key_node.value].get("$ref") \
                    not in OPTIONAL_FIELDS:
                visit(value_node, props[key_node.value], f"{path}.{key_node.value}")

    visit(yaml.compose(VALUES_TEXT), SCHEMA, "")
    assert missing == []


ROUTER_ONLY = {"policy", "service", "apiKey", "apiKeys"}
WORKER_ONLY = {"enabled", "engine", "startupTimeoutSeconds", "shm", "autoscaling"}


def test_pod_blocks_have_the_same_shape():
    router, prefill, decode = (set(VALUES[b]) for b in ("router", "prefill", "decode"))
    assert prefill == decode
    assert router - ROUTER_ONLY == prefill - WORKER_ONLY
    # What operators of llm-d's and production-stack's charts expect on every pod block.
    assert {"image", "podLabels", "securityContext", "podSecurityContext", "runtimeClassName",
            "strategy", "topologySpreadConstraints", "extraVolumes", "extraVolumeMounts",
            "initContainers", "resourceClaims"} <= router & prefill
    assert declared(SCHEMA["properties"]["prefill"]) == declared(SCHEMA["properties"]["decode"])
    shared = router & prefill
    worker_props = declared(SCHEMA["properties"]["prefill"])
    router_props = declared(SCHEMA["properties"]["router"])
    assert {k: router_props[k] for k in shared} == {k: worker_props[k] for k in shared}


def test_every_ref_is_local_and_resolves():
    refs = []

    def collect(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(SCHEMA)
    assert refs and all(r.startswith("#/") for r in refs)
    for ref in refs:
        assert resolve({"$ref": ref}), ref


def test_chart_metadata_follows_the_project():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "baton"
    assert chart["appVersion"] == project["version"]
    assert chart["kubeVersion"] == ">=1.29.0-0"  # the oldest schema the tests validate on
    for name in ("alerts.yaml", "alerts_test.yaml", "dashboard.json"):
        assert (CHART / "files" / name).is_file()
