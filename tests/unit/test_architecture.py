"""The package layout's rules, read from the source with `ast` (nothing is imported):

- no import cycles between `baton` modules, lazy (function-level) imports included;
- the router and `common` never load torch through module-level imports of `baton` modules
  (the runtime twin, `tests/unit/router/test_protocol.py::test_router_side_never_imports_torch`,
  imports the router's entry points; this one covers every module of both packages);
- every module keeps files under 400 lines and functions under 60, unless a
  `# size: <reason>` comment says why (just above the `def`, or in the file's header).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"
ROOT = "baton"

# Top-level packages that load torch when imported. `transformers` too: the router stays
# free of it (the runtime test checks both).
TORCH_LIKE = ("torch", "transformers", "triton", "baton_kernels", "baton_cpu")
TORCH_FREE_PACKAGES = ("baton.router", "baton.common")

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
SIZE_LIMITED = ("",)  # the whole package


# -- the modules and their imports --------------------------------------------------------
@dataclass
class Module:
    name: str  # dotted: baton.engine.core, or baton.engine for engine/__init__.py
    path: Path
    where: str  # the path to print: baton/engine/core.py
    tree: ast.Module
    is_package: bool

    @property
    def package(self) -> str:
        """The package relative imports start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Edge:
    target: str
    line: int
    module_level: bool
    implied: bool  # a parent package run by importing one of its modules


@dataclass
class Graph:
    modules: dict[str, Module]
    edges: dict[str, list[Edge]] = field(default_factory=dict)

    def targets(self, name: str, module_level_only: bool = False) -> set[str]:
        return {e.target for e in self.edges[name] if e.module_level or not module_level_only}


@cache
def project() -> Graph:
    return graph_of(SERVICES)


def graph_of(top: Path) -> Graph:
    """Every module under top/baton with its imports of other `baton` modules."""
    modules = {}
    for path in sorted((top / ROOT).rglob("*.py")):
        where = path.relative_to(top)
        parts = where.with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = Module(name, path, str(where), ast.parse(path.read_text(), str(path)),
                               is_package)
    graph = Graph(modules)
    for mod in modules.values():
        graph.edges[mod.name] = list(_edges(mod, modules))
    return graph


def _edges(mod: Module, modules: dict[str, Module]) -> Iterator[Edge]:
    """The `baton` modules `mod` imports, each with the line and whether the import runs at
    module level. Importing a.b.c also runs a and a.b: those edges are `implied`, and left
    out when the package is `mod`'s own parent (already initialised before `mod` runs)."""
    for node, module_level in _imports(mod.tree):
        for target, implied in _targets(node, mod, modules):
            own_parent = mod.name.startswith(target + ".")
            if target != mod.name and not (implied and own_parent):
                yield Edge(target, node.lineno, module_level, implied)


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement, and whether it runs at import time (not inside a function).
    Imports under `if TYPE_CHECKING:` never run and are skipped."""
    def walk(node: ast.AST, module_level: bool) -> Iterator:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                yield from walk(ast.Module(body=child.orelse, type_ignores=[]), module_level)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            else:
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, module_level and not inner)
    return walk(tree, True)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, mod: Module,
             modules: dict[str, Module]) -> Iterator[tuple[str, bool]]:
    """(module, implied) for each `baton` module the statement imports. `from pkg import x`
    goes to the submodule pkg.x when there is one (pkg is then only implied), else to pkg
    (whose __init__ must have defined x: an explicit edge)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield from _with_parents(_known(alias.name, modules), modules)
        return
    base = _known(_absolute(node, mod), modules)
    if base is None:
        return
    submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    only_submodules = len(submodules) == len(node.names)
    for target, implied in _with_parents(base, modules):
        yield target, implied or only_submodules
    for target in submodules:
        yield target, False


def _absolute(node: ast.ImportFrom, mod: Module) -> str | None:
    if node.level == 0:
        return node.module
    package = mod.package.split(".")
    if node.level - 1 >= len(package):
        return None
    base = ".".join(package[:len(package) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _known(name: str | None, modules: dict[str, Module]) -> str | None:
    """The longest prefix of `name` that is a `baton` module, or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(name: str | None, modules: dict[str, Module]) -> Iterator[tuple[str, bool]]:
    if name is None:
        return
    yield name, False
    parent = name.rpartition(".")[0]
    while parent:
        if parent in modules:
            yield parent, True
        parent = parent.rpartition(".")[0]


# -- (a) no cycles ------------------------------------------------------------------------
def _cycles(graph: Graph) -> list[list[str]]:
    """One cycle (a list of modules, first == last) per group of modules that all reach
    each other (a strongly connected component of more than one module)."""
    reach = {name: _reachable(graph, name) for name in graph.modules}
    components = {frozenset([m, *(n for n in reach[m] if m in reach[n])])
                  for m in graph.modules if m in reach[m]}
    return [_cycle_in(graph, set(c)) for c in sorted(components, key=min)]


def _reachable(graph: Graph, start: str) -> set[str]:
    """The modules `start` reaches in one import or more."""
    seen: set[str] = set()
    todo = list(graph.targets(start))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += graph.targets(node)
    return seen


def _cycle_in(graph: Graph, component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search)."""
    start = min(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.targets(node) & component):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")


def _describe(graph: Graph, cycle: list[str]) -> str:
    steps = [cycle[0]]
    for src, dst in zip(cycle, cycle[1:]):
        edge = min((e for e in graph.edges[src] if e.target == dst), key=lambda e: e.line)
        how = ("implied parent, " if edge.implied else "") + (
            "module level" if edge.module_level else "in a function")
        steps.append(f"-> {dst}  ({graph.modules[src].where}:{edge.line}, {how})")
    return "\n    ".join(steps)


def test_no_import_cycles():
    graph = project()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (break them: move the shared code to a module both " \
        "import, or pass it in):\n  " + "\n  ".join(_describe(graph, c) for c in cycles)


def test_the_import_graph_sees_lazy_relative_and_submodule_imports():
    graph = project()
    # baton/__init__.py imports the engine only inside `__getattr__`
    assert "baton.engine.llm" in graph.targets("baton")
    assert "baton.engine.llm" not in graph.targets("baton", module_level_only=True)
    # `from baton.engine import outputs` is the submodule, and runs baton.engine's __init__
    assert {"baton.engine.outputs", "baton.engine"} <= graph.targets("baton")
    # importing a.b.c runs a.b: the runner's import of models.loader reaches models/__init__
    runner = {e.target: e for e in graph.edges["baton.engine.runner.model_runner"]}
    assert runner["baton.engine.models.loader"].module_level
    assert runner["baton.engine.models"].implied
    # ... but not its own package's __init__, which ran before it
    assert "baton.engine.runner" not in runner


def test_the_checks_find_a_planted_cycle_and_torch_import(tmp_path):
    files = {
        "__init__.py": "",
        "router/__init__.py": "",
        "router/a.py": "from baton.router import b\n",  # a submodule, by name
        "router/b.py": "def lazy():\n    from . import a\n",  # relative, in a function
        "common/__init__.py": "",
        "common/c.py": "from baton.engine.x import y\n",
        "common/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "engine/__init__.py": "",
        "engine/x.py": "import torch\n\ny = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ROOT / rel).write_text(text)
    graph = graph_of(tmp_path)
    assert _cycles(graph) == [["baton.router.a", "baton.router.b", "baton.router.a"]]
    assert torch_loads(graph) == [
        "baton.common.c: baton/engine/x.py:1 torch, via baton.engine.x <- baton.common.c"]


# -- (b) torch stays out of the router and common ---------------------------------------
def _torch_imports(mod: Module) -> list[str]:
    """The torch-like imports `mod` runs at import time, as `path:line name`."""
    found = []
    for node, module_level in _imports(mod.tree):
        if not module_level or (isinstance(node, ast.ImportFrom) and node.level):
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        found += [f"{mod.where}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] in TORCH_LIKE]
    return found


def _loaded_with(graph: Graph, name: str) -> dict[str, str]:
    """Every `baton` module importing `name` runs at module level (its parent packages
    included), each mapped to the module that pulls it in."""
    parents = [p for p in _parents(name) if p in graph.modules]
    seen = {name: name, **{p: name for p in parents}}
    todo = [name, *parents]
    while todo:
        node = todo.pop()
        for target in graph.targets(node, module_level_only=True):
            if target not in seen:
                seen[target] = node
                todo.append(target)
    return seen


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def torch_loads(graph: Graph) -> list[str]:
    """`module: path:line torch, via a <- b <- module` for each module of the torch-free
    packages whose module-level imports load torch."""
    bad = []
    for name in sorted(graph.modules):
        if not name.startswith(TORCH_FREE_PACKAGES):
            continue
        loaded = _loaded_with(graph, name)
        for other in sorted(loaded):
            for hit in _torch_imports(graph.modules[other]):
                chain = [other]
                while chain[-1] != name:
                    chain.append(loaded[chain[-1]])
                bad.append(f"{name}: {hit}, via {' <- '.join(chain)}")
    return bad


def test_router_and_common_never_import_torch():
    bad = torch_loads(project())
    assert not bad, "torch-free packages load torch:\n  " + "\n  ".join(bad)


# -- (c) sizes ----------------------------------------------------------------------------
def _size_limited(graph: Graph) -> list[Module]:
    return [m for m in graph.modules.values()
            if m.where.removeprefix(f"{ROOT}/").startswith(SIZE_LIMITED)]


def _has_size_reason(lines: list[str]) -> bool:
    return any(line.lstrip().startswith("#") and "size:" in line
               and line.split("size:", 1)[1].strip() for line in lines)


def _header(mod: Module, lines: list[str]) -> list[str]:
    """The file's lines before its first statement after the docstring."""
    body = mod.tree.body
    first = body[1:2] if body and isinstance(body[0], ast.Expr) and isinstance(
        getattr(body[0], "value", None), ast.Constant) else body[:1]
    return lines[:first[0].lineno - 1] if first else lines


def _comments_above(lines: list[str], node: ast.AST) -> list[str]:
    """The comment lines right above a `def` (or its first decorator)."""
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    above = []
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
        above.append(lines[start])
    return above


def size_offenders(graph: Graph) -> list[str]:
    """`path: N lines` for each size-limited file over the limit, `path:line name: N lines`
    for each function, unless a `# size:` comment gives the reason."""
    found = []
    for mod in _size_limited(graph):
        lines = mod.path.read_text().splitlines()
        where = mod.where
        if len(lines) > MAX_FILE_LINES and not _has_size_reason(_header(mod, lines)):
            found.append(f"{where}: {len(lines)} lines (> {MAX_FILE_LINES})")
        for node in ast.walk(mod.tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _has_size_reason(
                    _comments_above(lines, node)):
                found.append(f"{where}:{node.lineno} {node.name}: {length} lines "
                             f"(> {MAX_FUNCTION_LINES})")
    return found


def test_the_size_check_honours_size_comments(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(60))  # 61-line functions
    files = {
        "__init__.py": "",
        "worker/__init__.py": "",
        "worker/long.py": f"def too_long():\n{body}\n\n# size: one table, read top down\n"
                          f"@staticmethod\ndef explained():\n{body}",
        "worker/big.py": '"""Doc."""\n# size: generated\n' + "x = 1\n" * 400,
        "engine/__init__.py": "",
        "engine/big.py": "x = 1\n" * 500,  # every path is size-limited
    }
    for rel, text in files.items():
        (tmp_path / ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ROOT / rel).write_text(text)
    assert size_offenders(graph_of(tmp_path)) == [
        "baton/engine/big.py: 500 lines (> 400)",
        "baton/worker/long.py:1 too_long: 61 lines (> 60)"]


def test_files_and_functions_stay_small():
    offenders = size_offenders(project())
    assert not offenders, "too big (split by concept, or say why in a `# size:` " \
        "comment):\n  " + "\n  ".join(offenders)
