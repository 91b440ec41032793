"""The import order, bottom to top: the runtime (``hkernels/runtime``) -> the hand-written Triton kernels, configs
and the op table -> the dispatcher -> the public functions -> the Helion kernels -> the modules, patching, hub,
tuning and the package itself -> bench. Every import points down (or within its layer), never up. Read from the
source (every import statement, top-level or inside a function), so a lazy import that points the wrong way is
caught too. (The dispatcher reaches a backend's kernels through ``hkernels.registry``'s ``importlib``, not an import
statement: which backend runs is data, not a dependency.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hkernels.runtime",),
    ("triton_fallback", "hkernels.configs", "hkernels.registry", "hkernels.requests"),
    ("hkernels.dispatch", "hkernels.fallback", "hkernels.introspect"),
    ("hkernels.functional",),
    ("hkernels.ops",),
    ("hkernels.nn", "hkernels.patch", "hkernels.hub", "hkernels.tune", "hkernels.warmup", "hkernels"),
    ("bench",),
)
PROJECT = ("hkernels", "triton_fallback", "bench")


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import statement in ``path`` (under ``root``); relative imports resolved to their
    package; ``from package import name`` as ``package.name`` (a submodule or not: the layer is the same)."""
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
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _layer(module: str) -> int:
    """The layer of a project module: that of the longest prefix named in LAYERS."""
    best, level = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), i
    return level


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("package", PROJECT)
def test_imports_point_one_way(package):
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module} (layer {_layer(module)} above {_layer(_module(path))})"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in PROJECT and _layer(module) > _layer(_module(path))
    ]
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer():
    missing = [_module(path) for package in PROJECT for path in sorted((ROOT / package).rglob("*.py"))
               if _layer(_module(path)) < 0]
    assert not missing, missing


def test_the_runtime_imports_nothing_of_the_project_but_itself():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / "hkernels" / "runtime").rglob("*.py"))
             for line, module in _imports(path)
             if module.split(".")[0] in PROJECT and not module.startswith("hkernels.runtime")]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_lazy_import(tmp_path):
    """The reader finds an import inside a function body and resolves a relative one."""
    pkg = tmp_path / "triton_fallback"
    pkg.mkdir()
    source = pkg / "m.py"
    source.write_text("def f():\n    from hkernels import configs\n    from . import _common\n")
    assert _imports(source, tmp_path) == [(2, "hkernels.configs"), (3, "triton_fallback._common")]
    assert _layer("hkernels.configs") == 1 and _layer("hkernels.runtime.plan") == 0 and _layer("hkernels") == 5
