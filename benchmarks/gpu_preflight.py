"""gpu_check's preflight: import every module of Baton's packages and name each missing import,
with the modules that need it, before any test runs (a lease must not end on a collection
error).

    python -m benchmarks.gpu_preflight [--json preflight.json]

`status` is ok when everything the check runs imports; a missing package that only a part the
check never runs needs (the planner's Kubernetes client, plots, GGUF reading: the kit leaves
them out) is listed under `left_out`, not a failure. Exit 0 when ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
import traceback
from pathlib import Path

PACKAGES = ("baton", "baton_kernels", "baton_loadtest", "benchmarks")
# Imports the check's pieces need, and for what.
NEEDED = {"torch": "everything", "triton": "the Triton kernels", "transformers": "models",
          "safetensors": "weights", "tokenizers": "the tokenizer", "pytest": "the GPU tests",
          "pydantic": "the services' messages", "fastapi": "the worker", "uvicorn": "the worker",
          "aiohttp": "the router", "openai": "the scenarios",
          "jsonschema": "tools", "llguidance": "structured outputs",
          "prometheus_client": "metrics", "yaml": "configs", "jinja2": "chat templates"}
# Packages the kit leaves out on purpose (scripts/gpu_kit.py NOT_NEEDED), by import name.
LEFT_OUT = {"matplotlib", "kubernetes", "gguf", "accelerate"}


def missing_name(err: BaseException) -> str | None:
    name = getattr(err, "name", None)
    return name.split(".")[0] if isinstance(err, ImportError) and name else None


def try_import(module: str) -> tuple[str | None, str | None]:
    """(missing top-level package or None, error text or None)."""
    try:
        importlib.import_module(module)
    except BaseException as err:  # noqa: BLE001 - a module failing at import is the finding
        text = "".join(traceback.format_exception_only(type(err), err)).strip()
        return missing_name(err), text
    return None, None


def all_modules(package: str) -> list[str]:
    missing, error = try_import(package)
    if error:
        return [package]
    pkg = sys.modules[package]
    return [package, *(m.name for m in pkgutil.walk_packages(pkg.__path__, package + "."))]


def preflight() -> dict:
    started = time.monotonic()
    missing: dict[str, list[str]] = {}
    broken: dict[str, str] = {}
    modules = [m for p in PACKAGES for m in all_modules(p)]
    for name in [*NEEDED, *modules]:
        gone, error = try_import(name)
        if gone:
            missing.setdefault(gone, []).append(name)
        elif error:
            broken[name] = error
    from baton.kv_transfer import NIXL_MODULES

    nixl = next((m for m in NIXL_MODULES if try_import(m)[1] is None), None)
    needed_missing = {k: v for k, v in missing.items() if k not in LEFT_OUT}
    return {
        "status": "ok" if not needed_missing and not broken else "failed",
        "modules": len(modules),
        "missing": {k: {"needed_by": v[:8], "count": len(v),
                        "for": NEEDED.get(k, "modules listed")}
                    for k, v in needed_missing.items()},
        "left_out": {k: v[:8] for k, v in missing.items() if k in LEFT_OUT},
        "broken": broken,
        "nixl": nixl or "not importable: the kv_nixl scenario will fail",
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = preflight()
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
