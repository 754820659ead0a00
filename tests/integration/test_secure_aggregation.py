"""Secure aggregation end to end: `edgepfl simulate --secure-aggregation` over a real Mosquitto
broker trains to the plain run's model within the quantization error, unsharded and with each
shard's aggregator summing its devices' masked vectors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from coordinator.run.folder import RunFolder
from side_by_side import finished
from side_by_side import start as start_command
from saved_runs import checkpoint_at

pytestmark = pytest.mark.integration


def start(out, broker, *flags: str, clients: int = 5, rounds: int = 3) -> subprocess.Popen:
    """`edgepfl simulate` started in the background (one worker process: the runs compared are made alike),
    under its own federation on the one broker."""
    return start_command([sys.executable, "-m", "coordinator.cli", "simulate", "--dataset", "digits",
                          "--clients", str(clients), "--rounds", str(rounds), "--workers", "1", "--seed", "1",
                          "--broker", broker.url, "--out", str(out), "--quiet", "--aggregation-dtype", "float64",
                          *flags])


def assert_same_model(plain, secure, atol: float) -> None:
    """The secure run's global state is the plain run's within `atol`."""
    expected = checkpoint_at(RunFolder(plain).checkpoint).state
    actual = checkpoint_at(RunFolder(secure).checkpoint).state
    for group, arrays in expected.items():
        for key, value in arrays.items():
            assert np.allclose(actual[group][key], value, atol=atol), f"{group}/{key}"


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_a_secure_run_trains_the_plain_run_s_model(tmp_path, mosquitto, algorithm):
    # Execute: the same runs plain and under secure aggregation, of one round and of three, side by side
    keys = [(kind, rounds) for kind in ("plain", "secure") for rounds in (1, 3)]
    flags = {"plain": (), "secure": ("--secure-aggregation",)}
    runs = dict(zip(keys, finished(*(start(tmp_path / f"{kind}{rounds}", mosquitto, "--algorithm", algorithm,
                                           *flags[kind], rounds=rounds) for kind, rounds in keys)), strict=True))

    # Assert: every round unmasked all five. One aggregation moves the model by the quantization
    # error alone (under 1e-7 here); over three rounds local training amplifies that difference
    # (by 1e-4 to 1e-3, depending on the rounding draws), and the accuracy stays the plain run's
    for (kind, rounds), run in runs.items():
        assert run.returncode == 0, f"{kind} {rounds}: " + run.stdout + run.stderr
    assert_same_model(tmp_path / "plain1", tmp_path / "secure1", atol=1e-6)
    report = json.loads(RunFolder(tmp_path / "secure3").report.read_text())
    assert [r["secagg"]["unmasked"] for r in report["rounds"]] == [5, 5, 5]
    assert [r["participants"] for r in report["rounds"]] == [5, 5, 5]
    assert "secure aggregation     3 of 3 rounds unmasked, 0 devices lost" in runs["secure", 3].stdout
    assert_same_model(tmp_path / "plain3", tmp_path / "secure3", atol=1e-2)
    plain_report = json.loads(RunFolder(tmp_path / "plain3").report.read_text())
    assert report["final"]["personalized_accuracy"]["mean"] == pytest.approx(
        plain_report["final"]["personalized_accuracy"]["mean"], abs=0.02)


def test_a_sharded_secure_run_trains_the_plain_run_s_model(tmp_path, mosquitto):
    # Execute: six devices, two shards of three (their aggregators are processes of the simulation), one
    # aggregation (its model moves by the quantization error alone)
    plain, secure = finished(start(tmp_path / "plain", mosquitto, "--algorithm", "fedrep", clients=6, rounds=1),
                             start(tmp_path / "secure", mosquitto, "--algorithm", "fedrep", "--secure-aggregation",
                                   "--shards", "2", clients=6, rounds=1))

    # Assert
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert secure.returncode == 0, secure.stdout + secure.stderr
    report = json.loads(RunFolder(tmp_path / "secure").report.read_text())
    assert [r["secagg"]["unmasked"] for r in report["rounds"]] == [6]
    assert all(r["lost_shards"] == [] and r["secagg"]["failed_groups"] == [] for r in report["rounds"])
    assert_same_model(tmp_path / "plain", tmp_path / "secure", atol=1e-6)


def test_repper_with_weak_devices_releases_from_secure_sums_to_the_plain_run_s_accuracy(tmp_path, mosquitto):
    # Execute: seven devices, three of them weak (ONNX Runtime and a head), two rounds
    flags = ("--algorithm", "repper", "--lite-fraction", "0.43")
    plain, secure = finished(start(tmp_path / "plain", mosquitto, *flags, clients=7, rounds=2),
                             start(tmp_path / "secure", mosquitto, *flags, "--secure-aggregation", clients=7, rounds=2))

    # Assert: the weak devices' prototypes were one secure sum over the three; every device,
    # weak ones included, scores what it scores in the plain run
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert secure.returncode == 0, secure.stdout + secure.stderr
    metrics = [json.loads(line) for line in RunFolder(tmp_path / "secure").metrics.read_text().splitlines()]
    pools = {m["pool"]: m for m in metrics if m.get("event") == "secure_pool"}
    assert pools["prototypes"]["unmasked"] == 3 and pools["prototypes"]["failed"] is None
    reports = {kind: json.loads(RunFolder(tmp_path / kind).report.read_text()) for kind in ("plain", "secure")}
    for device in ("dev004", "dev005", "dev006"):
        assert reports["secure"]["final"]["per_client"][device]["kind"] == "lite"
    for device, result in reports["plain"]["final"]["per_client"].items():
        assert reports["secure"]["final"]["per_client"][device]["accuracy"] == pytest.approx(result["accuracy"],
                                                                                            abs=0.03), device
