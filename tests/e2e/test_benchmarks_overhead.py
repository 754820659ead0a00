"""benchmarks/overhead.py --quick: the same run over MQTT and in-process, identical results."""

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


def test_overhead_quick_compares_mqtt_with_the_in_process_loop(tmp_path):
    variants = "amqtt,mosquitto,inprocess" if mosquitto_binary() else "amqtt,inprocess"

    command = [sys.executable, "-m", "benchmarks.overhead", "--quick", "--variants", variants, "--workers", "1",
               "--out", str(tmp_path)]  # one worker process per variant: the layout is the same for all three
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "overhead.json").read_text())
    for key in ("machine", "settings", "variants", "ratios", "targets", "baseline"):
        assert key in data
    assert list(data["variants"]) == variants.split(",")
    for name, run in data["variants"].items():
        assert "error" not in run, (name, run)
        assert [r["round"] for r in run["rounds"]] == [1, 2]
        assert all(r["seconds"] > 0 and r["participants"] == 3 for r in run["rounds"])
    accuracies = [run["final_accuracy"] for run in data["variants"].values()]
    assert max(accuracies) - min(accuracies) <= 0.05, "the same seeds and data must give (nearly) the same model"
    for name in variants.split(",")[:-1]:
        assert data["ratios"][name]["ratio"] > 0
        assert len(data["ratios"][name]["ratio_per_round"]) == 2
    assert data["variants"]["amqtt"]["rounds"][0]["bytes_up"] > 0
    for name in variants.split(",")[:-1]:  # the coordinator's channel, from its RoundEnded events
        assert all(r["coordinator_send_seconds"] > 0 and r["coordinator_accept_seconds"] > 0
                   for r in data["variants"][name]["rounds"])
    assert "| variant |" in (tmp_path / "overhead.md").read_text()
    assert (tmp_path / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
