"""The mutation check's ledger: a fingerprint changes with the broken module, the tests that must catch
the break, their conftest files and helpers, and the mutation itself, and with nothing else."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from mutation_check import MUTATIONS, ROOT
from mutation_ledger import covered_files, fingerprint, read_ledger, write_ledger


@dataclass(frozen=True)
class Break:
    name: str
    module: str
    replacements: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


BREAK = Break("fedx: no term", "edge_sdk/fedx.py", (("a + b", "a"),), ("tests/unit/test_fedx.py::test_loss",))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    files = {
        "edge_sdk/fedx.py": "def loss(a, b):\n    return a + b\n",
        "edge_sdk/other.py": "VALUE = 1\n",
        "tests/conftest.py": "ROOT_FIXTURES = 1\n",
        "tests/unit/conftest.py": "UNIT_FIXTURES = 1\n",
        "tests/objectives.py": "def expected(a, b):\n    return a + b\n",
        "tests/unused_helper.py": "X = 1\n",
        "tests/unit/test_fedx.py": ("from objectives import expected\n\n"
                                    "def test_loss():\n    assert expected(1, 2) == 3\n"),
        "tests/unit/test_other.py": "def test_other():\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_fingerprint_covers_the_module_the_test_file_its_conftests_and_its_helpers(tree):
    # Execute
    covered = [path.relative_to(tree).as_posix() for path in covered_files(tree, BREAK)]

    # Assert
    assert covered == ["edge_sdk/fedx.py", "tests/conftest.py", "tests/unit/conftest.py", "tests/unit/test_fedx.py",
                       "tests/objectives.py"]


@pytest.mark.parametrize("changed", ["edge_sdk/fedx.py", "tests/unit/test_fedx.py", "tests/objectives.py",
                                     "tests/conftest.py", "tests/unit/conftest.py"])
def test_a_change_to_a_covered_file_changes_the_fingerprint(tree, changed):
    # Prepare
    before = fingerprint(tree, BREAK)

    # Execute
    (tree / changed).write_text((tree / changed).read_text() + "# changed\n")

    # Assert
    assert fingerprint(tree, BREAK) != before


@pytest.mark.parametrize("changed", ["edge_sdk/other.py", "tests/unused_helper.py", "tests/unit/test_other.py"])
def test_a_change_elsewhere_keeps_the_fingerprint(tree, changed):
    # Prepare
    before = fingerprint(tree, BREAK)

    # Execute
    (tree / changed).write_text((tree / changed).read_text() + "# changed\n")

    # Assert
    assert fingerprint(tree, BREAK) == before


@pytest.mark.parametrize("field, value", [("replacements", (("a + b", "b"),)), ("tests", ("tests/unit/test_fedx.py",)),
                                          ("name", "fedx: another")])
def test_a_changed_mutation_has_another_fingerprint(tree, field, value):
    assert fingerprint(tree, replace(BREAK, **{field: value})) != fingerprint(tree, BREAK)


def test_the_ledger_reads_back_what_was_written_and_is_empty_when_absent(tmp_path):
    # Prepare
    path = tmp_path / "mutations_caught.json"

    # Execute
    absent = read_ledger(path)
    write_ledger(path, {"b": "2", "a": "1"})

    # Assert
    assert absent == {}
    assert read_ledger(path) == {"a": "1", "b": "2"}
    assert path.read_text().index('"a"') < path.read_text().index('"b"')


def test_every_defined_mutation_has_a_fingerprint_over_files_that_exist():
    # Execute
    prints = {mutation.name: fingerprint(ROOT, mutation) for mutation in MUTATIONS}

    # Assert
    assert len(prints) == len(MUTATIONS)  # names are unique, so the ledger has one entry each
    assert len(set(prints.values())) == len(MUTATIONS)
