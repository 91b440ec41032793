"""The import order: bench -> hkernels -> triton_fallback, never back up. Read from the source (every import
statement, top-level or inside a function), so a lazy import that points the wrong way is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the packages of this project it may not import (those above it)
ABOVE = {"triton_fallback": ("hkernels", "bench"), "hkernels": ("bench",)}


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import statement in ``path`` (under ``root``); relative imports resolved to their
    package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_imports_point_one_way(package):
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in ABOVE[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_lazy_import(tmp_path):
    """The reader finds an import inside a function body and resolves a relative one."""
    pkg = tmp_path / "triton_fallback"
    pkg.mkdir()
    source = pkg / "m.py"
    source.write_text("def f():\n    from hkernels import configs\n    from . import _common\n")
    assert _imports(source, tmp_path) == [(2, "hkernels"), (3, "triton_fallback")]
