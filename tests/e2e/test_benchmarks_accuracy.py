"""benchmarks/accuracy.py --quick: the script runs end to end and writes the documented JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_accuracy_quick_writes_tables_heads_and_holdout(tmp_path):
    command = [sys.executable, "-m", "benchmarks.accuracy", "--quick", "--out", str(tmp_path)]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "accuracy.json").read_text())
    for key in ("benchmark", "machine", "config", "runs", "table", "heads", "holdout", "target", "reference",
                "failures"):
        assert key in document
    assert {"date", "cores", "ram_gib", "cpu_model", "python", "torch", "command"} <= set(document["machine"])
    assert document["failures"] == []
    runs = document["runs"]
    assert {(r["algorithm"], r["setting"], r["seed"], r["status"]) for r in runs} == {
        ("fedavg", "dir0.5@1", 0, "ok"), ("repper", "dir0.5@1", 0, "ok")}
    for run in runs:
        assert run["rounds"] == 2
        assert 0.0 <= run["personalized_accuracy"]["mean"] <= 1.0
        assert run["mb_up_per_round"] > 0
    cells = document["table"]["dir0.5@1"]
    assert set(cells) == {"fedavg", "repper"}
    assert all(cell["n"] == 1 and 0.0 <= cell["mean"] <= 1.0 for cell in cells.values())
    heads = document["heads"]["table"]["dir0.5@1"]
    assert set(heads) == {"fedavg", "repper"}
    for algorithm in heads.values():
        assert set(algorithm) == {"MLP", "SVM", "LR", "in_run", "varying"}
        assert all(0.3 < algorithm[n]["mean"] <= 1.0 for n in ("MLP", "SVM", "LR"))  # 10 classes: chance is 0.1
        assert 0.1 < algorithm["varying"]["mean"] <= 1.0  # a trained body; a dead one has ~0
    holdout = document["holdout"]
    assert holdout["holdout_clients"] == 2
    for row in holdout["rows"]:
        assert row["status"] == "ok"
        assert row["holdout_devices"] == ["dev008", "dev009"]
        assert 0.0 <= row["holdout_accuracy"] <= 1.0
    assert document["target"]["evaluated"] is False
    markdown = (tmp_path / "accuracy.md").read_text()
    assert "| method (%) | Dir(0.5), seed 0 | over FedAvg |" in markdown and "| RepPer |" in markdown
    assert (tmp_path / "accuracy_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((tmp_path / "accuracy.json").read_text())
    assert all(r["cached"] for r in rerun["runs"])  # the second invocation reuses the finished runs
    assert rerun["table"] == document["table"]

    first = tmp_path / "first.json"
    first.write_text(json.dumps(document))
    merged_out = tmp_path / "merged"
    fedavg_only = [sys.executable, "-m", "benchmarks.accuracy", "--dataset", "digits", "--clients", "10",
                   "--rounds", "2", "--algorithms", "fedavg", "--settings", "dir0.5@1", "--seeds", "0",
                   "--holdout", "0", "--cache", str(tmp_path / "runs"), "--ledger", "none", "--merge", str(first),
                   "--out", str(merged_out)]

    merging = subprocess.run(fedavg_only, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert merging.returncode == 0, merging.stderr[-3000:]
    combined = json.loads((merged_out / "accuracy.json").read_text())
    assert [(r["algorithm"], r["cached"], r.get("merged_from")) for r in combined["runs"]] == [
        ("fedavg", True, None), ("repper", False, str(first))]
    assert combined["table"] == document["table"]
    assert set(combined["heads"]["table"]["dir0.5@1"]) == {"fedavg", "repper"}
    assert f"Merged from `{first}`" in (merged_out / "accuracy.md").read_text()
