"""Imports point one way, and `engine/__init__.py` is a working public API.

The order, bottom first (docs/architecture.md draws it):
    engine:  core < text < structured < kvcache < registry < speculative < scheduler < executor
             < loading
             < the orchestration modules at engine/*.py (llm_engine, async_engine, ...)
    packages: engine < gateway < replicas < prefixgate (the command)

Each engine package imports only itself and the packages below it; `gateway` and `replicas`
import the engine's public API (`from engine import ...`) and nothing inside it; `gateway`
never imports `replicas` or `prefixgate`, `replicas` never imports `prefixgate`; the engine
imports no web or Ray code; and no modules import each other in a cycle. Sources are parsed
with `ast` (no import side effects), so a lazy or TYPE_CHECKING-only import counts too.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import engine
import engine.core.errors

ROOT = Path(engine.__file__).resolve().parent.parent
PACKAGES = ("engine", "gateway", "replicas", "prefixgate")  # bottom first
ENGINE_LAYERS = (
    "core",
    "text",
    "structured",
    "kvcache",
    "registry",
    "speculative",
    "scheduler",
    "executor",
    "loading",
)
TOP = len(ENGINE_LAYERS)  # engine/*.py: the orchestration on top of every layer
WEB_OR_RAY = frozenset(
    {"gateway", "replicas", "prefixgate", "ray", "starlette", "sse_starlette", "uvicorn"}
    | {"fastapi", "httpx"}
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {
    _module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
}


@dataclass(frozen=True, slots=True)
class Import:
    line: int
    module: str  # absolute, resolved to a module of ours where the name is one


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import statement and literal dynamic import in `source`, made absolute."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend(Import(node.lineno, name) for name in _from_targets(node, package))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(node.lineno, arg.value))
    return found


def _from_targets(node: ast.ImportFrom, package: list[str]) -> Iterator[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        kept = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else []
        base = ".".join([*kept, node.module] if node.module else kept)
    for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
        submodule = f"{base}.{alias.name}" if base else alias.name
        yield submodule if submodule in SOURCES or not base else base


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def engine_layer(module: str) -> int | None:
    """The layer of an engine module (TOP for engine/*.py and `engine` itself)."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    if len(parts) > 1 and parts[1] in ENGINE_LAYERS:
        return ENGINE_LAYERS.index(parts[1])
    return TOP


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when it may."""
    top = imported.split(".")[0]
    here = importer.split(".")[0]
    if here == "engine":
        if top in WEB_OR_RAY:
            return "the engine imports no web, Ray or gateway code"
        if imported == "engine":
            return "engine modules import their layer's modules, not the public API"
        below, above = engine_layer(imported), engine_layer(importer)
        if below is not None and above is not None and below > above:
            return f"{ENGINE_LAYERS[above]} is below {_layer_name(below)}"
        return None
    if top in PACKAGES and PACKAGES.index(top) > PACKAGES.index(here):
        return f"{here} is below {top}"
    if here in {"gateway", "replicas"} and top == "engine" and imported != "engine":
        return f"{here} uses the engine's public API (`from engine import ...`) only"
    return None


def _layer_name(layer: int) -> str:
    return ENGINE_LAYERS[layer] if layer < TOP else "the engine's top modules"


def violations(module: str, source: str) -> list[str]:
    is_package = SOURCES.get(module, Path()).name == "__init__.py"
    return [
        f"line {i.line}: {i.module} ({why})"
        for i in imports_of(source, module, is_package)
        if (why := violation(module, i.module)) is not None
    ]


def import_graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours each one imports."""
    graph: dict[str, set[str]] = {}
    for module, path in SOURCES.items():
        found = imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        graph[module] = {i.module for i in found if i.module in SOURCES and i.module != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# -- the tree ------------------------------------------------------------------------------------
def test_every_package_and_layer_is_found() -> None:
    assert {"engine", "gateway.cli", "replicas.app", "prefixgate.cli"} <= set(SOURCES)
    layers = {m.split(".")[1] for m in SOURCES if m.count(".") >= 2 and m.startswith("engine.")}
    assert layers == set(ENGINE_LAYERS)


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_module_imports_point_down(module: str) -> None:
    assert violations(module, SOURCES[module].read_text(encoding="utf-8")) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


# -- the checker itself: it must catch every spelling, and nothing else -------------------------
@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "engine.core.sequence",
            "from engine.registry.file import PrefixSpec",
            ["line 1: engine.registry.file (core is below registry)"],
        ),
        (
            "engine.kvcache.manager",
            "if TYPE_CHECKING:\n    from engine.scheduler.scheduler import Scheduler",
            ["line 2: engine.scheduler.scheduler (kvcache is below scheduler)"],
        ),
        (
            "engine.executor.runner",
            "def f():\n    from engine.llm_engine import LLMEngine",
            ["line 2: engine.llm_engine (executor is below the engine's top modules)"],
        ),
        (
            "engine.registry.loader",
            "from ..scheduler import scheduler",
            ["line 1: engine.scheduler.scheduler (registry is below scheduler)"],
        ),
        (
            "engine.text.chat",
            "importlib.import_module('engine.loading.source')",
            ["line 1: engine.loading.source (text is below loading)"],
        ),
        (
            "engine.llm_engine",
            "from engine import LLMEngine",
            ["line 1: engine (engine modules import their layer's modules, not the public API)"],
        ),
        (
            "engine.executor.runner",
            "import httpx",
            ["line 1: httpx (the engine imports no web, Ray or gateway code)"],
        ),
        (
            "engine.core.errors",
            "from ... import gateway",  # escapes the engine package
            ["line 1: gateway (the engine imports no web, Ray or gateway code)"],
        ),
        (
            "gateway.cli",
            "def f():\n    from replicas.app import serve_on_ray",
            ["line 2: replicas.app (gateway is below replicas)"],
        ),
        (
            "gateway.state",
            "from engine.core.errors import EngineError",
            [
                "line 1: engine.core.errors "
                "(gateway uses the engine's public API (`from engine import ...`) only)"
            ],
        ),
        (
            "replicas.affinity",
            "from engine.kvcache.block_hash import scope_seed",
            [
                "line 1: engine.kvcache.block_hash "
                "(replicas uses the engine's public API (`from engine import ...`) only)"
            ],
        ),
        (
            "replicas.app",
            "import prefixgate.cli",
            ["line 1: prefixgate.cli (replicas is below prefixgate)"],
        ),
    ],
)
def test_checker_flags_upward_imports(module: str, source: str, expected: list[str]) -> None:
    assert violations(module, source) == expected


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("engine.registry.loader", "from engine.kvcache.block_pool import BlockPool"),
        ("engine.registry.loader", "from engine.registry.index import PrefixIndex"),
        ("engine.executor.runner", "from engine.scheduler.scheduler import SchedulerOutput"),
        ("engine.executor.models.llama", "from ..attention import ForwardBatch"),
        ("engine.llm_engine", "from engine.loading.setup import load_engine_parts"),
        ("engine.async_engine", "from engine.llm_engine import LLMEngine"),
        ("engine.core.config", "import torch\nimport gatewayish\nx = 'gateway'"),
        ("gateway.state", "from engine import AsyncEngine"),
        ("replicas.app", "from gateway.app import create_app\nimport ray"),
        ("prefixgate.cli", "from replicas.app import serve_on_ray\nfrom gateway import cli"),
    ],
)
def test_checker_allows_downward_imports(module: str, source: str) -> None:
    assert violations(module, source) == []


def test_cycle_finder() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# -- the public API -----------------------------------------------------------------------------
def _declared_all() -> list[str]:
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            return [ast.literal_eval(element) for element in node.value.elts]
    raise AssertionError("engine/__init__.py does not assign a literal __all__")


def test_init_declares_all_as_unique_strings() -> None:
    names = _declared_all()
    assert names
    assert all(isinstance(name, str) for name in names)
    assert len(names) == len(set(names))
    assert names == list(engine.__all__)


@pytest.mark.parametrize("name", list(engine.__all__))
def test_every_name_in_all_is_importable(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from engine import {name}", namespace)
    assert namespace[name] is getattr(engine, name)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from engine import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(engine.__all__)


def test_every_engine_error_is_public() -> None:
    """The gateway maps each error class to a status, importing them from `engine` only."""
    errors = {
        name
        for name, obj in inspect.getmembers(engine.core.errors, inspect.isclass)
        if issubclass(obj, engine.core.errors.EngineError)
    }
    assert errors
    assert errors <= set(engine.__all__)
