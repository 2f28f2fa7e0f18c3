"""The engine never imports web code, and `engine/__init__.py` is a working public API.

Imports point one way (`gateway -> engine -> torch / transformers / yaml`): this parses every
engine source with `ast` (no import side effects, so a lazy or TYPE_CHECKING-only import is
caught too) and fails on any import of the gateway or a web library.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import engine
import engine.errors

ENGINE_DIR = Path(engine.__file__).resolve().parent
FORBIDDEN = frozenset(
    {"gateway", "replicas", "ray", "starlette", "sse_starlette", "uvicorn", "fastapi", "httpx"}
)
ENGINE_SOURCES = sorted(ENGINE_DIR.rglob("*.py"))


def _package_of(path: Path) -> list[str]:
    """The dotted package a module lives in: engine/models/llama.py -> ["engine", "models"]."""
    parts = ["engine", *path.relative_to(ENGINE_DIR).parts]
    return parts[:-1]


def _imported_modules(tree: ast.AST, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import statement and literal dynamic import."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend((node.lineno, name) for name in _from_import_targets(node, package))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def _from_import_targets(node: ast.ImportFrom, package: list[str]) -> list[str]:
    if node.level == 0:
        return [node.module or ""]
    base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else []
    if node.module:
        return [".".join([*base, node.module])]
    # `from .. import x`: each name may itself be a module.
    return [".".join([*base, alias.name]) for alias in node.names]


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def forbidden_imports(source: str, package: list[str]) -> list[str]:
    """`"line N: module"` for each import of a forbidden top-level package."""
    tree = ast.parse(source)
    return [
        f"line {line}: {module}"
        for line, module in _imported_modules(tree, package)
        if module.split(".")[0] in FORBIDDEN
    ]


def test_engine_sources_are_found() -> None:
    names = {p.relative_to(ENGINE_DIR).as_posix() for p in ENGINE_SOURCES}
    assert {"__init__.py", "async_engine.py", "llm_engine.py", "models/llama.py"} <= names


@pytest.mark.parametrize(
    "path", ENGINE_SOURCES, ids=[p.relative_to(ENGINE_DIR).as_posix() for p in ENGINE_SOURCES]
)
def test_engine_module_imports_no_web_code(path: Path) -> None:
    assert forbidden_imports(path.read_text(encoding="utf-8"), _package_of(path)) == []


# The checker itself: it must catch every spelling, and nothing else.
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import gateway", ["line 1: gateway"]),
        ("import gateway.app as app", ["line 1: gateway.app"]),
        ("import os, httpx", ["line 1: httpx"]),
        ("from starlette.responses import Response", ["line 1: starlette.responses"]),
        ("from sse_starlette import EventSourceResponse", ["line 1: sse_starlette"]),
        ("def f():\n    import uvicorn", ["line 2: uvicorn"]),
        ("if TYPE_CHECKING:\n    from fastapi import FastAPI", ["line 2: fastapi"]),
        ("from .. import gateway", ["line 1: gateway"]),  # escapes the engine package
        ("from ..gateway.app import x", ["line 1: gateway.app"]),
        ("importlib.import_module('gateway.cli')", ["line 1: gateway.cli"]),
        ("__import__('httpx')", ["line 1: httpx"]),
    ],
)
def test_checker_flags_web_imports(source: str, expected: list[str]) -> None:
    assert forbidden_imports(source, ["engine"]) == expected


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nimport engine.kv_cache",
        "from engine.errors import EngineError",
        "from . import kv_cache\nfrom .sampler import Sampler",
        "from ..kv_cache import BlockPool",  # from engine/models: stays inside engine
        "import gatewayish\nimport httpx_like",
        "x = 'gateway'",
    ],
)
def test_checker_allows_other_imports(source: str) -> None:
    assert forbidden_imports(source, ["engine", "models"]) == []


# -- the public API -----------------------------------------------------------------------------
def _declared_all() -> list[str]:
    tree = ast.parse((ENGINE_DIR / "__init__.py").read_text(encoding="utf-8"))
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
        for name, obj in inspect.getmembers(engine.errors, inspect.isclass)
        if issubclass(obj, engine.errors.EngineError)
    }
    assert errors
    assert errors <= set(engine.__all__)
