"""benchmarks/workers.py --quick: runs end to end and writes its documented results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.brokers import require_mosquitto

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_workers_quick_writes_the_per_device_memory(tmp_path):
    require_mosquitto()

    command = [sys.executable, "-m", "benchmarks.workers", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "workers.json").read_text())
    assert {"date", "cores", "cpu_model", "command"} <= set(data["machine"])
    (row,) = data["rows"]
    assert row["setting"] == "cnn8 (digits)"
    assert [run["devices"] for run in row["runs"]] == [4, 8]
    assert all(run["rss_per_device_mib"] > 0 and run["rss_before_mib"] > 0 for run in row["runs"])
    assert "| cnn8 (digits) | 8 |" in (tmp_path / "workers.md").read_text()
