"""docs/architecture.md's module map lists every module in the tree, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "gateway", "replicas", "prefixgate")
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
_PATH_TOKEN = re.compile(r"^[\w.]+(/|\.py|\.cpp|\.h)$")


def mapped_paths(text: str) -> set[str]:
    """Every file the module map names, as a path from the repository root.

    The map is an indented tree: a token ending in `/` opens a folder at its indentation,
    file names that start a line (several may share one) sit in the innermost folder
    indented less than them, and the words after them are their description."""
    block = _map_block(text)
    folders: list[tuple[int, str]] = []
    found: set[str] = set()
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        tokens = []
        for token in line.split():
            if not _PATH_TOKEN.match(token):
                break
            tokens.append(token)
        if not tokens:
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        for token in tokens:
            if token.endswith("/"):
                folders.append((indent, parent + token))
            else:
                found.add(parent + token)
    return found


def _map_block(text: str) -> str:
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    return next(b for b in blocks if b.startswith("engine/"))


def tree_paths() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*")
        if p.suffix in SOURCE_SUFFIXES and p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_the_module_map_lists_every_module_and_nothing_else() -> None:
    mapped = mapped_paths((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    tree = tree_paths()
    assert {"engine/core/sequence.py", "gateway/routes/chat.py", "prefixgate/cli.py"} <= tree
    assert sorted(tree - mapped) == [], "modules the map does not list"
    assert sorted(mapped - tree) == [], "the map lists modules that are not in the tree"


def test_the_map_reader() -> None:
    text = (
        "## Module map\n\n```\nengine/   top\n  core/   data\n    a.py  b.py   two files\n"
        "                 a description line mentioning c.py\n  d.py      top-level\n"
        "  kernels/\n    k.cpp   C++\nother/\n  e.py  (x.py)\n```\n## Next\n"
    )
    assert mapped_paths(text) == {
        "engine/core/a.py",
        "engine/core/b.py",
        "engine/d.py",
        "engine/kernels/k.cpp",
        "other/e.py",
    }
