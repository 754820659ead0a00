"""benchmarks/aggregation.py --quick: runs end to end and writes its documented results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"sha256", "reassembly", "wire_decode", "codec_decode_fp16", "codec_decode_int8", "check_arrays",
          "check_update", "check_update_norm", "delta_norm", "fold", "fold_float64", "validate_fold",
          "decode_validate_fold", "reassemble_decode_validate_fold"}


def test_aggregation_quick_writes_stages_shards_and_targets(tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.aggregation", "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "aggregation.json").read_text())
    assert {"date", "cores", "cpu_model", "command"} <= set(data["machine"])
    assert data["library"]["folder"] == str(ROOT)
    assert {row["stage"] for row in data["stages"]} == STAGES
    assert {row["model"] for row in data["stages"]} == {"0.1MB", "cnn32-3.7MB"}
    assert all(row["mb_per_s_best"] > 0 and row["mb_per_cpu_s_best"] > 0 for row in data["stages"])
    assert [row["shards"] for row in data["shards"]] == [1, 2, 4]
    assert all(row["updates"] == 4 and row["mb_per_s"] > 0 for row in data["shards"])
    assert data["shards"][0]["scaling"] == 1.0
    assert data["targets"]["validate_fold_met"] in (True, False)
    assert "| reassemble_decode_validate_fold |" in (tmp_path / "aggregation.md").read_text()
