"""benchmarks/transport.py --quick: runs end to end and writes its documented results."""

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


def test_transport_quick_writes_json_table_and_plot(tmp_path):
    brokers = "mosquitto,amqtt" if mosquitto_binary() else "amqtt"

    command = [sys.executable, "-m", "benchmarks.transport", "--quick", "--brokers", brokers, "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "transport.json").read_text())
    for key in ("machine", "settings", "wire", "overhead", "transfers", "wire_overhead_ratio", "targets"):
        assert key in data
    assert {"date", "cores", "cpu_model", "python", "command"} <= set(data["machine"])
    assert [row["payload_mb"] for row in data["wire"]] == [1, 10]
    assert all(row["encode_mb_per_s"] > 0 and row["decode_mb_per_s"] > 0 for row in data["wire"])
    transfers = [row for row in data["transfers"] if row.get("mode") == "channel"]
    assert {row["broker"] for row in transfers} == set(brokers.split(","))
    for row in transfers:
        assert "error" not in row, row
        assert row["mb_per_s"] > 0 and row["frames_received"] == row["frames_sent"] >= 1
        assert row["received_bytes"] == row["sent_bytes"]
    assert 1.0 < data["wire_overhead_ratio"] < 1.1
    assert data["targets"]["wire_overhead_met"] in (True, False)
    assert "| broker | chunk |" in (tmp_path / "transport.md").read_text()
    assert (tmp_path / "transport.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
