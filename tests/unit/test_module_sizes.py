"""The library's modules stay small: none over 600 lines, no class over 400, and the
coordinator's own module (coordinator/server.py) at most 350, so that each keeps one job and
the round modes stay in coordinator/players/. At most 15 modules sit directly under
coordinator/: the rest live in its named subpackages (docs/LAYOUT.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edge_sdk", "coordinator", "export")
MAX_MODULE_LINES, MAX_CLASS_LINES = 600, 400
MAX_LINES = {"coordinator/server.py": 350}
MAX_TOP_LEVEL_MODULES = 15  # coordinator/*.py, __init__.py included


def library_files() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def class_sizes(tree: ast.Module) -> dict[str, int]:
    """Each class's lines, from its `class` line (or first decorator) to its last."""
    return {node.name: (node.end_lineno or node.lineno) - min([node.lineno] + [d.lineno for d in node.decorator_list])
            + 1 for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_no_module_is_over_its_limit():
    # Prepare
    files = library_files()

    # Execute
    over = {}
    for path in files:
        name = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES.get(name, MAX_MODULE_LINES):
            over[name] = lines

    # Assert
    assert files
    assert over == {}


def test_no_class_is_over_400_lines():
    # Prepare
    files = library_files()

    # Execute
    over = {f"{path.relative_to(ROOT).as_posix()}:{name}": size for path in files
            for name, size in class_sizes(ast.parse(path.read_text())).items() if size > MAX_CLASS_LINES}

    # Assert
    assert over == {}


def test_at_most_15_modules_sit_directly_under_coordinator():
    # Prepare
    package = ROOT / "coordinator"

    # Execute
    top_level = sorted(path.name for path in package.glob("*.py"))

    # Assert
    assert "server.py" in top_level
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, f"{len(top_level)} modules: {top_level}; move some into subpackages"
