"""benchmarks/communication.py --quick: the script runs end to end and writes the documented JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_communication_quick_writes_bytes_target_codecs_and_dc_pfl_modes(tmp_path):
    command = [sys.executable, "benchmarks/communication.py", "--quick", "--out", str(tmp_path)]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "communication.json").read_text())
    for key in ("benchmark", "machine", "config", "per_round", "to_target", "codecs", "dc_pfl", "reference",
                "failures"):
        assert key in document
    assert document["failures"] == []
    rows = {r["algorithm"]: r for r in document["per_round"]["digits"]}
    assert set(rows) == {"fedavg", "repper"}
    fedavg = rows["fedavg"]
    assert fedavg["mb_up_per_round"] > 0 and fedavg["mb_down_per_round"] > 0
    # every device uploads the whole model; the broadcast reaches all 10 devices
    assert fedavg["kb_up_per_device_round"] * 10 == pytest.approx(fedavg["mb_up_per_round"] * 1e3)
    assert fedavg["mb_down_delivered_per_round"] == pytest.approx(10 * fedavg["mb_down_per_round"])
    assert fedavg["by_kind"]["up"]["train_res"] > 0
    target = document["to_target"]
    assert {r["algorithm"] for r in target["rows"]} == {"fedavg", "repper"}
    for row in target["rows"]:
        assert isinstance(row["reached"], bool)
        assert (row["round"] is not None) == row["reached"]
        if row["reached"]:
            assert 1 <= row["round"] <= 2 and row["mb_total"] > 0
    codecs = {r["codec"]: r for r in document["codecs"]["rows"]}
    assert document["codecs"]["available"] is True
    assert set(codecs) == {"fp32", "int8"}
    assert codecs["int8"]["up_ratio"] < 0.5  # int8 carries a quarter of fp32's bytes, plus scales and framing
    assert 0.0 <= codecs["int8"]["accuracy"] <= 1.0
    modes = {(r["covariance"], r["transport"]): r for r in document["dc_pfl"]}
    assert set(modes) == {("full", "fp32"), ("lowrank:4", "fp16")}
    assert modes[("lowrank:4", "fp16")]["kb_up_per_device_round"] < modes[("full", "fp32")]["kb_up_per_device_round"]
    assert "| method |" in (tmp_path / "communication.md").read_text()
    assert (tmp_path / "communication_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
