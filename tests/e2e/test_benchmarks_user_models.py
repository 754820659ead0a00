"""benchmarks/user_models.py --quick: user networks of two task kinds train through `Federation`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_user_models_quick_trains_both_user_networks(tmp_path):
    command = [sys.executable, "-m", "benchmarks.user_models", "--quick", "--out", str(tmp_path)]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "user_models.json").read_text())
    assert {"cores", "torch", "code"} <= set(document["machine"])
    assert len(document["results"]) == 2
    for rows in document["results"].values():
        (row,) = rows
        assert row["algorithm"] == "repper" and 0.5 <= row["mean"] <= 1.0 and row["mb_up"] > 0
    assert "| repper |" in (tmp_path / "user_models.md").read_text()
