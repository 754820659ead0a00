"""benchmarks/weak_bodies.py --quick: the weak devices' heads on each algorithm's released body
(digits, FedAvg and FedRep, 2 rounds, embedded broker, trained side by side), and the refusal of
a personal body."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def weak_bodies(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.weak_bodies", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_every_head_is_scored_on_each_released_body_and_a_rerun_reads_the_same_figures(tmp_path):
    # Execute: the runs side by side, each fitting its heads in its own process; then the tables
    # again from the cache alone
    first = weak_bodies("--quick", "--jobs", "2", "--out", str(tmp_path))
    again = weak_bodies("--quick", "--cached-only", "--out", str(tmp_path / "again"), "--cache", str(tmp_path / "runs"))

    # Assert: a row per algorithm, every head an accuracy, the run's own figure beside them
    assert first.returncode == 0, first.stdout + first.stderr
    assert again.returncode == 0, again.stdout + again.stderr
    rows = json.loads((tmp_path / "weak_bodies.json").read_text())["runs"]
    assert [(r["algorithm"], r["status"]) for r in rows] == [("fedavg", "ok"), ("fedrep", "ok")]
    for row in rows:
        assert set(row["heads"]) == {"svm", "lr", "mlp", "ncm"}
        assert all(0.0 <= value <= 1.0 for value in row["heads"].values())
        assert 0.0 <= row["in_run"] <= 1.0
    assert json.loads((tmp_path / "again" / "weak_bodies.json").read_text())["runs"] == rows
    table = (tmp_path / "weak_bodies.md").read_text()
    assert "| body of | seeds | SVM | LR | MLP | NCM | in run |" in table and "| FedRep | 0 |" in table


def test_an_algorithm_whose_body_is_personal_is_refused_by_name(tmp_path):
    result = weak_bodies("--dataset", "digits", "--algorithms", "lg_fedavg", "--out", str(tmp_path))
    assert result.returncode != 0
    assert "lg_fedavg keep(s) part of the body personal" in result.stderr
