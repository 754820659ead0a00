"""`edgepfl coordinator` with devices that split their own data: over a real Mosquitto it reports
what the devices told it (example counts, label histograms), never a partition it did not make."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.run.report_files import label_skew
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.transport import MqttSettings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 3


def test_a_coordinator_without_a_partition_reports_the_devices_data(mosquitto, tmp_path):
    # Prepare: three devices holding a Dirichlet(0.5) split the coordinator is not told about
    federation, out = "datareport", tmp_path / "run"
    stop = threading.Event()
    settings = MqttSettings(url=mosquitto.url)
    devices = [EdgeClient(f"dev{i}", load_client_data("digits", num_clients=DEVICES, index=i, seed=3,
                                                      partition="dirichlet", alpha=0.5),
                          broker=settings, federation=federation, state_dir=tmp_path / f"dev{i}")
               for i in range(DEVICES)]
    threads = [threading.Thread(target=d.run, args=(stop,), daemon=True) for d in devices]
    for thread in threads:
        thread.start()

    # Execute
    try:
        result = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "coordinator", "--algorithm", "fedrep", "--dataset", "digits",
             "--clients", str(DEVICES), "--rounds", "1", "--local-epochs", "1", "--broker", mosquitto.url,
             "--federation", federation, "--out", str(out), "--registration-timeout", "120",
             "--round-timeout", "120"],
            capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

    # Assert: the report and the summary state the devices' data, and no partition
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    counts = {d.client_id: d.data.class_counts().tolist() for d in devices}
    examples = {d.client_id: d.data.num_train for d in devices}
    assert "partition" not in report
    data = report["data"]
    assert data["per_device"] == {cid: {"kind": "trainer", "examples": examples[cid], "labels": counts[cid]}
                                  for cid in counts}
    assert (data["devices"], data["examples"]) == (DEVICES, sum(examples.values()))
    assert (data["min_examples"], data["max_examples"]) == (min(examples.values()), max(examples.values()))
    assert (data["labels_reported"], data["labels_malformed"]) == (DEVICES, 0)
    assert data["label_skew"] == pytest.approx(label_skew(list(counts.values())))
    assert data["label_skew"] > 0.1  # Dirichlet(0.5) over 3 devices: far from the pooled label mix
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"algorithm fedrep on digits ({DEVICES} devices, model ")
    assert "iid" not in result.stdout
    assert (f"data                   {DEVICES} devices, {sum(examples.values())} examples "
            f"(min {min(examples.values())}, max {max(examples.values())}), labels reported by {DEVICES} "
            f"(skew {data['label_skew']:.2f})") in lines
