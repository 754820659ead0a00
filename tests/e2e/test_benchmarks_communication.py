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
    command = [sys.executable, "-m", "benchmarks.communication", "--quick", "--out", str(tmp_path)]

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


def _accuracy_run(algorithm: str, seed: int, curve: list[float], mb_up: float, mb_down: float) -> dict:
    return {"algorithm": algorithm, "setting": "dir0.1@1", "seed": seed, "status": "ok",
            "mb_up_per_round": mb_up, "mb_down_per_round": mb_down,
            "curve": [[round_, mean] for round_, mean in enumerate(curve, start=1)]}


def test_over_seeds_reads_rounds_and_mb_to_target_off_accuracy_curves(tmp_path):
    # Prepare: an accuracy.py result with 4 devices; a round moves 2 MB up + 4 x 0.5 MB delivered
    accuracy = {
        "machine": {"code": "abc1234"}, "config": {"clients": 4},
        "runs": [_accuracy_run("repper", 0, [0.5, 0.91, 0.95], 2.0, 0.5),
                 _accuracy_run("repper", 1, [0.92, 0.93, 0.94], 2.0, 0.5),
                 _accuracy_run("fedavg", 0, [0.3, 0.6, 0.89], 2.0, 0.5),
                 {"algorithm": "fedavg", "setting": "dir0.1@1", "seed": 1, "status": "failed"},
                 _accuracy_run("fedavg", 0, [0.95], 2.0, 0.5) | {"setting": "dir0.5@1"}],
    }
    source = tmp_path / "accuracy.json"
    source.write_text(json.dumps(accuracy))
    command = [sys.executable, "-m", "benchmarks.communication", "--cached-only", "--algorithms", "",
               "--codec-algorithms", "", "--dc-modes", "", "--rounds", "3", "--cache", str(tmp_path / "runs"),
               "--ledger", "none", "--over-seeds", str(source), "--out", str(tmp_path / "out")]

    # Execute
    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)

    # Assert
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads((tmp_path / "out" / "communication.json").read_text())["to_target_over_seeds"]
    rows = {r["algorithm"]: r for r in table["rows"]}
    assert set(rows) == {"fedavg", "repper"}
    repper = rows["repper"]
    assert repper["seeds"]["0"] == {"round": 2, "mb_total": 8.0, "best": 0.95}
    assert repper["seeds"]["1"]["round"] == 1 and repper["seeds"]["1"]["mb_total"] == 4.0
    assert repper["reached_on"] == 2 and repper["mb_total"]["mean"] == 6.0
    fedavg = rows["fedavg"]
    assert set(fedavg["seeds"]) == {"0"}  # the failed seed and the other setting left out
    assert fedavg["seeds"]["0"]["round"] is None and fedavg["reached_on"] == 0
    markdown = (tmp_path / "out" / "communication.md").read_text()
    assert "| RepPer | 2, 8.00 | 1, 4.00 | 6.00 ± 2.00 |" in markdown
    assert "| FedAvg | - (89.00) | not run | - |" in markdown


def test_over_seeds_without_runs_of_the_setting_fails_before_training(tmp_path):
    source = tmp_path / "accuracy.json"
    source.write_text(json.dumps({"machine": {}, "config": {"clients": 4}, "runs": []}))
    command = [sys.executable, "-m", "benchmarks.communication", "--algorithms", "fedavg", "--over-seeds", str(source),
               "--cache", str(tmp_path / "runs"), "--ledger", "none", "--out", str(tmp_path / "out")]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)

    assert result.returncode != 0
    assert "no finished runs of setting dir0.1@1" in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing trained
