"""The compatibility matrix (coordinator/compatibility.py, tests/matrix.py): each cell run over
the loopback broker completes or is refused at start exactly as docs/COMPATIBILITY.md says, the
docs table is the one the code generates, and the README's `--mode async` column agrees.

Every run regenerates the whole docs table (each cell's refusal, or none, as a Coordinator of its
run gives it) and compares. A default run plays a rotating subset of the cells (every algorithm's
plain cell and one cell per feature, chosen by the day's seed, or EDGEPFL_MATRIX_SEED);
EDGEPFL_MATRIX=full plays every cell.
"""

from __future__ import annotations

import datetime
import os
import random
import re
from pathlib import Path

import pytest

from coordinator import compatibility
from coordinator.compatibility import FEATURE_BY_NAME, FEATURES, algorithm_ids
from matrix import play

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "COMPATIBILITY.md"
FULL = os.environ.get("EDGEPFL_MATRIX") == "full"


def selected_cells() -> list[tuple[str, str]]:
    """Every cell under EDGEPFL_MATRIX=full; else every algorithm's plain cell and, per feature,
    one algorithm drawn by the seed (EDGEPFL_MATRIX_SEED, the day's ordinal unless set)."""
    algorithms = algorithm_ids()
    if FULL:
        return [(a, f.name) for a in algorithms for f in FEATURES]
    seed = int(os.environ.get("EDGEPFL_MATRIX_SEED", datetime.date.today().toordinal()))
    rng = random.Random(seed)
    drawn = {feature.name: rng.choice(algorithms) for feature in FEATURES[1:]}
    return [(a, f.name) for a in algorithms for f in FEATURES if f.name == "plain" or drawn.get(f.name) == a]


def documented() -> dict[tuple[str, str], str | None]:
    """The docs table's cells: the refusal's message in full, None for `yes` (and `fails`, a
    cell that starts: KNOWN_FAILURES)."""
    text = DOC.read_text()
    messages = dict(re.findall(r"^(\d+)\. (.+)$", text, flags=re.M))
    cells: dict[tuple[str, str], str | None] = {}
    for line in text.splitlines():
        match = re.match(r"^\| `(\w+)` \|(.+)\|$", line)
        if match:
            values = [v.strip() for v in match.group(2).split("|")]
            for feature, value in zip(FEATURES, values, strict=True):
                number = re.search(r"^refused: .*\[(\d+)\]$", value)
                cells[match.group(1), feature.name] = messages[number.group(1)] if number else None
    return cells


SOURCES: dict[str, Path] = {}  # each algorithm's finished plain run, for its warm-start cells


def known_failure(algorithm: str, feature: str) -> list:
    """A strict xfail for a cell of KNOWN_FAILURES (its fix turns the test red until it is taken out)."""
    why = compatibility.KNOWN_FAILURES.get((algorithm, feature))
    return [] if why is None else [pytest.mark.xfail(strict=True, reason=why)]


CELLS = [pytest.param(a, f, id=f"{a}-{f}", marks=known_failure(a, f)) for a, f in selected_cells()]


@pytest.mark.parametrize(("algorithm", "feature"), CELLS)
def test_a_cell_completes_or_is_refused_at_start_as_documented(algorithm, feature, tmp_path_factory, quiet_torch):
    # Prepare
    expected = documented()[algorithm, feature]

    # Execute
    outcome = play(tmp_path_factory.mktemp(f"{algorithm}-{feature}"), algorithm, FEATURE_BY_NAME[feature], SOURCES)

    # Assert
    assert outcome.failure is None, outcome.failure
    assert outcome.refused == expected


def test_the_docs_table_names_every_algorithm_and_feature():
    assert sorted({a for a, _ in documented()}) == sorted(algorithm_ids())
    assert len(documented()) == len(algorithm_ids()) * len(FEATURES)


def test_every_documented_refusal_is_the_coordinator_s_own():
    # Prepare: the first cell the docs give each refusal
    first: dict[str, tuple[str, str]] = {}
    for cell, message in documented().items():
        if message is not None:
            first.setdefault(message, cell)

    # Assert: a Coordinator of that cell's run refuses with it
    for message, (algorithm, feature) in first.items():
        assert compatibility.refusal(algorithm, FEATURE_BY_NAME[feature]) == message, (algorithm, feature)


def test_the_docs_table_is_the_generated_one():
    # every cell's refusal (or none) as the code gives it today: a minute, no cell run
    generated = compatibility.with_table(DOC.read_text(), compatibility.table(compatibility.all_refusals()))
    assert DOC.read_text() == generated, "run: python -m coordinator.compatibility --write docs/COMPATIBILITY.md"


def test_the_readme_async_column_agrees_with_the_matrix():
    # Prepare: the README's algorithm table, `yes` or `no: why` in its `--mode async` column
    rows = re.findall(r"^\| `(\w+)` \|.*\| (yes|no:[^|]*) \|$", (ROOT / "README.md").read_text(), flags=re.M)
    assert sorted(a for a, _ in rows) == sorted(algorithm_ids())

    # Assert
    for algorithm, readme in rows:
        refused = compatibility.refusal(algorithm, FEATURE_BY_NAME["async"])
        assert (readme == "yes") == (refused is None), f"{algorithm}: README says {readme!r}, the matrix {refused!r}"
