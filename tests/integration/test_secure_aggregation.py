"""Secure aggregation end to end: `edgepfl simulate --secure-aggregation` over a real Mosquitto
broker trains to the plain run's model within the quantization error, unsharded and with each
shard's aggregator summing its devices' masked vectors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from coordinator import checkpoint
from coordinator.run_folder import RunFolder

pytestmark = pytest.mark.integration


def simulate(out, broker, *flags: str, clients: int = 5) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--dataset", "digits", "--clients", str(clients),
               "--rounds", "3", "--workers", "2", "--seed", "1", "--broker", broker.url, "--out", str(out), "--quiet",
               "--aggregation-dtype", "float64", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_a_secure_run_trains_the_plain_run_s_model(tmp_path, mosquitto, algorithm):
    # Execute: the same run plain and under secure aggregation
    plain = simulate(tmp_path / "plain", mosquitto, "--algorithm", algorithm)
    secure = simulate(tmp_path / "secure", mosquitto, "--algorithm", algorithm, "--secure-aggregation")

    # Assert: every round unmasked all five; the global model and the accuracies those of the plain run
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert secure.returncode == 0, secure.stdout + secure.stderr
    report = json.loads(RunFolder(tmp_path / "secure").report.read_text())
    assert [r["secagg"]["unmasked"] for r in report["rounds"]] == [5, 5, 5]
    assert [r["participants"] for r in report["rounds"]] == [5, 5, 5]
    assert "secure aggregation     3 of 3 rounds unmasked, 0 devices lost" in secure.stdout
    expected = checkpoint.load(RunFolder(tmp_path / "plain").checkpoint).state
    actual = checkpoint.load(RunFolder(tmp_path / "secure").checkpoint).state
    for group, arrays in expected.items():
        for key, value in arrays.items():
            assert np.allclose(actual[group][key], value, atol=1e-4), f"{group}/{key}"
    plain_report = json.loads(RunFolder(tmp_path / "plain").report.read_text())
    assert report["final"]["personalized_accuracy"]["mean"] == pytest.approx(
        plain_report["final"]["personalized_accuracy"]["mean"], abs=0.02)


def test_a_sharded_secure_run_trains_the_plain_run_s_model(tmp_path, mosquitto):
    # Execute: six devices, two shards of three (their aggregators are processes of the simulation)
    plain = simulate(tmp_path / "plain", mosquitto, "--algorithm", "fedrep", clients=6)
    secure = simulate(tmp_path / "secure", mosquitto, "--algorithm", "fedrep", "--secure-aggregation", "--shards", "2",
                      clients=6)

    # Assert
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert secure.returncode == 0, secure.stdout + secure.stderr
    report = json.loads(RunFolder(tmp_path / "secure").report.read_text())
    assert [r["secagg"]["unmasked"] for r in report["rounds"]] == [6, 6, 6]
    assert all(r["lost_shards"] == [] and r["secagg"]["failed_groups"] == [] for r in report["rounds"])
    expected = checkpoint.load(RunFolder(tmp_path / "plain").checkpoint).state
    actual = checkpoint.load(RunFolder(tmp_path / "secure").checkpoint).state
    for key, value in expected["shared"].items():
        assert np.allclose(actual["shared"][key], value, atol=1e-4), key
