"""benchmarks/edge.py --quick: the script runs end to end and writes the documented JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_edge_quick_exports_quantizes_and_times_heads(tmp_path):
    command = [sys.executable, "-m", "benchmarks.edge", "--quick", "--out", str(tmp_path)]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "edge.json").read_text())
    assert {"date", "cores", "cpu_model", "python", "torch", "onnxruntime", "command", "code"} <= set(
        document["machine"])
    (row,) = document["models"]
    assert (row["model"], row["dataset"]) == ("cnn8", "digits")
    assert row["max_abs_diff_vs_torch"] < 1e-4
    assert 0 < row["int8_bytes"] < 0.5 * row["fp32_bytes"]
    assert 0.5 <= row["probe_accuracy_fp32"] <= 1.0 and abs(row["accuracy_change_points"]) <= 5.0
    assert all(seconds > 0 for seconds in row["latency_ms_batch1"].values())
    assert set(document["head_fit_seconds"]) == {"svm", "lr", "mlp", "ncm"}
    assert "| cnn8 (digits) |" in (tmp_path / "edge.md").read_text()
