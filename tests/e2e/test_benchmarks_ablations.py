"""benchmarks/ablations.py --quick: the script runs DualFed's ablation rows end to end, two at a time
(`--jobs 2`), evaluating only after the last round (`--eval-every 2`), and writes the claim table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_ablations_quick_runs_the_rows_and_measures_their_claims(tmp_path):
    command = [sys.executable, "-m", "benchmarks.ablations", "--quick", "--eval-every", "2", "--workers", "1",
               "--out", str(tmp_path)]

    result = subprocess.run([*command, "--jobs", "2"], check=False, cwd=ROOT, capture_output=True, text=True,
                            timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "ablations-digits-2rounds.json").read_text())
    assert document["failures"] == []
    rows = {row["id"]: row for row in document["rows"]}
    assert set(rows) == {"full", "simultaneous", "no_projector", "fedavg"}
    assert rows["simultaneous"]["overrides"] == {"schedule": "simultaneous"}
    for row in rows.values():
        assert row["paper"] == "dualfed" and row["setting"] == "dir0.5@1"
        assert set(row["seeds"]) == {"0"} and 0.0 <= row["seeds"]["0"] <= 1.0
    runs = {row["runs"]["0"] for row in rows.values()}
    assert len(runs) == 4  # each switch is a run of its own, cached apart
    assert all("-e2-" in run for run in runs)  # the evaluation period names the run
    assert document["config"]["eval_every"] == 2
    claims = {claim["claim"]: claim for claim in document["claims"]}
    measured = claims["E=1: simultaneous > stage-wise"]
    difference = rows["simultaneous"]["seeds"]["0"] - rows["full"]["seeds"]["0"]
    assert measured["differences"] == [pytest.approx(difference)]
    assert measured["reproduced"] == ("yes (1 seed)" if difference > 0 else "no (1 seed)")
    assert claims["with projector > without"]["reproduced"].endswith("(1 seed)")
    assert not any("more epochs" in text for text in claims)  # neither of its rows was asked for
    markdown = (tmp_path / "ablations-digits-2rounds.md").read_text()
    assert "| DualFed, simultaneous | DualFed, schedule=simultaneous | 1 |" in markdown
    assert "| paper | claim | source | measured here | reproduced? |" in markdown
    assert "Devices evaluated every 2 rounds and after the last." in markdown
    assert "(4 runs)." in markdown.split("Runs trained on: ")[1].splitlines()[0]

    again = subprocess.run([*command, "--cached-only"], check=False, cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "ablations-digits-2rounds.json").read_text())["rows"] == document["rows"]
