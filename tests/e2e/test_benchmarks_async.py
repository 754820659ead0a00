"""benchmarks/async.py --quick: synchronous rounds and async steps of FedAvg and FedRep on the
same fleet (digits, 12 devices online half of the time, 10x apart in speed, Mosquitto), the 12 devices in
one worker process (each worker imports torch; the fleet is what the test is about, not the process count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_each_algorithm_runs_in_both_modes_with_its_curve_and_staleness(tmp_path):
    # Execute
    command = [sys.executable, "-m", "benchmarks.async", "--quick", "--workers", "1", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    # Assert: four runs, each with its curve; the async ones with their staleness
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "async.json").read_text())
    runs = document["runs"]
    assert [(r["algorithm"], r["mode"]) for r in runs] == [("fedavg", "sync"), ("fedavg", "async"),
                                                          ("fedrep", "sync"), ("fedrep", "async")]
    buffer = document["plan"]["buffer"]
    for run in runs:
        assert run["curve"] and all(0 <= p["accuracy"] <= 1 for p in run["curve"])
        assert [p["seconds"] for p in run["curve"]] == sorted(p["seconds"] for p in run["curve"])
        reached = [run["to_target"][str(t)] for t in document["plan"]["targets"]]
        assert all(r is None or (r["seconds"] <= run["seconds"] and r["mb"] <= run["mb"]) for r in reached)
        if run["mode"] == "async":
            summary = run["asynchronous"]
            assert summary["steps"] == run["steps"] and summary["arrivals"] == sum(summary["staleness"].values())
            assert summary["arrivals"] == sum(run["participation"]) >= run["steps"] * buffer // 2
        else:
            assert run["asynchronous"] is None
    table = (tmp_path / "async.md").read_text()
    assert "| fedrep | async |" in table and "**Staleness of the updates folded (async)**" in table
