"""The mutation check's ledger: which mutations were caught, on which code and tests.

A mutation's fingerprint is a SHA-256 over the mutation itself (its module, replacements and tests),
the text of the module it breaks, and the text of the tests that must catch it: their files, the
conftest files above them and the helper modules of `tests/` those files import. A mutation whose
fingerprint is in the ledger was caught on exactly that code and those tests, so `--changed` runs only
the others; a full pass (`--record`) writes the ledger anew. What the fingerprint leaves out (the
rest of the library, through which a test reaches the broken line) is what the full pass is for.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Protocol

LEDGER_NAME = "mutations_caught.json"
ABOUT = ("The mutations each caught on the code and tests their fingerprint covers "
         "(tests/mutation_ledger.py); written by `python tests/mutation_check.py --record`.")


class Breaks(Protocol):
    """What the ledger reads of a mutation (tests/mutation_check.py's Mutation)."""

    @property
    def name(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def replacements(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def tests(self) -> tuple[str, ...]: ...


def helper_modules(test_file: Path, tests_root: Path) -> list[Path]:
    """The modules directly under `tests_root` that `test_file` imports by name (`tests/objectives.py`...)."""
    tree = ast.parse(test_file.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return sorted(tests_root / f"{name}.py" for name in names if (tests_root / f"{name}.py").is_file())


def covered_files(root: Path, mutation: Breaks) -> list[Path]:
    """Every file whose text the fingerprint covers, the broken module first."""
    tests_root = root / "tests"
    found: list[Path] = [root / mutation.module]
    for test in sorted({t.split("::")[0] for t in mutation.tests}):
        path = root / test
        folders = [folder for folder in path.parents if folder.is_relative_to(tests_root)]
        found += [folder / "conftest.py" for folder in reversed(folders) if (folder / "conftest.py").is_file()]
        found += [path, *helper_modules(path, tests_root)]
    return list(dict.fromkeys(found))


def fingerprint(root: Path, mutation: Breaks) -> str:
    """SHA-256 (hex) of the mutation and of the text of every file it covers, paths included."""
    digest = hashlib.sha256(json.dumps([mutation.name, mutation.module, mutation.replacements,
                                        mutation.tests]).encode())
    for path in covered_files(root, mutation):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def read_ledger(path: Path) -> dict[str, str]:
    """Mutation name -> the fingerprint it was caught at; empty when there is no ledger yet."""
    if not path.is_file():
        return {}
    caught = json.loads(path.read_text())["caught"]
    if not isinstance(caught, dict) or not all(isinstance(v, str) for v in caught.values()):
        raise ValueError(f"{path}: 'caught' must map mutation names to fingerprints")
    return caught


def write_ledger(path: Path, caught: dict[str, str]) -> None:
    """Write the ledger, sorted by name, so that a new record reads as a small diff."""
    path.write_text(json.dumps({"about": ABOUT, "caught": dict(sorted(caught.items()))}, indent=1) + "\n")
