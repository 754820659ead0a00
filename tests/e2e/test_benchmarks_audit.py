"""benchmarks/audit.py --quick: the accountant's epsilon against the audit's lower bound for the
three DP modes as built (no violation) and without their noise (a violation each), in the table
and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_audit_quick_finds_the_broken_mechanisms_and_only_them(tmp_path):
    command = [sys.executable, "-m", "benchmarks.audit", "--quick", "--out", str(tmp_path)]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "audit.json").read_text())
    rows = document["rows"]
    assert {(r["mode"], r["noise_scale"]) for r in rows} == {(mode, scale) for mode in ("central", "local",
                                                             "distributed") for scale in (1.0, 0.0)}
    for row in rows:
        assert 0 < row["accountant_epsilon"] <= 1.0
        assert row["violated"] == (row["noise_scale"] == 0.0), row
    assert document["machine"]["command"].endswith("--quick --out " + str(tmp_path))
    assert (tmp_path / "audit.md").read_text().count("VIOLATION") == 3
