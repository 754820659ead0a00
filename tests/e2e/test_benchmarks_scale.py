"""benchmarks/scale.py --quick: a coordinator process and tens of real MQTT devices through Mosquitto."""

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


def test_scale_quick_registers_every_device_and_receives_every_update(tmp_path):
    require_mosquitto()

    command = [sys.executable, "-m", "benchmarks.scale", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "scale.json").read_text())
    for key in ("machine", "settings", "runs", "targets"):
        assert key in data
    assert [run["devices"] for run in data["runs"]] == [20, 50]
    for run in data["runs"]:
        assert "error" not in run, run
        assert run["registration_seconds"] > 0
        assert run["model_bytes"] > 0 and run["rss_before_round_1_bytes"] > 0
        assert run["updates_sent"] == run["devices"] * data["settings"]["rounds"]
        assert [r["round"] for r in run["rounds"]] == [1, 2]
        for r in run["rounds"]:
            assert r["updates_accepted"] == run["devices"] and r["all_updates_received"]
            assert r["latency_seconds"] > 0 and r["aggregation_seconds"] > 0
            assert r["peak_rss_bytes"] >= r["rss_at_begin_bytes"] > 0
    assert data["targets"]["no_update_lost"] is True
    assert "| devices |" in (tmp_path / "scale.md").read_text()
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
