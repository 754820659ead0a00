"""benchmarks/secagg.py --quick: a plain and a secure run of the same devices over Mosquitto, and
in-process rounds whose devices stop after key sharing unmask exactly the survivors' sum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.brokers import mosquitto_binary

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(mosquitto_binary() is None, reason="the benchmark starts a Mosquitto (apt-get install mosquitto)")
def test_secagg_quick_measures_the_secure_rounds_against_the_plain_ones(tmp_path):
    # Execute
    command = [sys.executable, "-m", "benchmarks.secagg", "--quick", "--workers", "1",  # one torch import
               "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    # Assert: one row of 4 devices, every device unmasked, the secure model within the quantization's bound
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "secagg.json").read_text())
    assert {"machine", "settings", "targets", "broker", "inprocess"} <= set(data)
    [row] = data["broker"]
    assert (row["devices"], row["rounds"]) == (4, 1)
    assert row["unmasked_all"] and row["secagg"][0]["unmasked"] == 4 and row["secagg"][0]["dropped"] == []
    assert row["secure_bytes_up"] > row["plain_bytes_up"] > 0
    assert row["secure_bytes_down"] > row["plain_bytes_down"] > 0
    assert row["bytes_up_ratio"] == pytest.approx(row["secure_bytes_up"] / row["plain_bytes_up"])
    assert row["plain_seconds"] > 0 and row["secure_seconds"] > 0
    quantization = row["quantization"]
    assert quantization["within_bound"] and quantization["coordinates"] == row["parameters"]
    assert quantization["max_abs_difference"] <= 1e-4

    # Assert: the in-process rounds, with 0, 1 and 3 of 10 devices gone after key sharing, sum exactly
    assert [(r["dropped"], r["devices"], r["length"], r["degree"]) for r in data["inprocess"]] == [
        (0, 10, 1000, 9), (1, 10, 1000, 9), (3, 10, 1000, 9)]
    assert all(r["failed"] is None and r["exact"] is True for r in data["inprocess"])
    assert all(r["unmask_seconds"] > 0 for r in data["inprocess"])
    table = (tmp_path / "secagg.md").read_text()
    assert "| model | parameters | devices |" in table and "exact survivors' sum" in table
