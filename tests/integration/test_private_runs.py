"""Private runs end to end: `edgepfl simulate` under DP over a real Mosquitto broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator.privacy.accountant import PrivacyAccountant, local_epsilon
from coordinator.run.folder import RunFolder

pytestmark = pytest.mark.integration


def simulate(out, broker, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--dataset", "digits", "--clients", "6",
               "--rounds", "3", "--workers", "2", "--seed", "2", "--broker", broker.url, "--out", str(out), "--quiet",
               *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_central_dp_run_calibrated_to_epsilon_8_reports_what_it_spent(tmp_path, mosquitto):
    # Execute: FedAvg, 3 of 6 devices a round, z calibrated to spend epsilon 8 over 3 rounds
    result = simulate(tmp_path / "run", mosquitto, "--algorithm", "fedavg", "--fraction", "0.5",
                      "--dp", "central", "--dp-epsilon", "8", "--dp-delta", "1e-3")

    # Assert: the budget spent (to the calibration's tolerance), per round and at the end
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(tmp_path / "run").report.read_text())
    privacy = report["privacy"]
    assert 0.97 * 8 <= privacy["epsilon"] <= 8
    accountant = PrivacyAccountant("rdp", "fixed", 1e-3)
    for _ in range(3):
        accountant.add_round(6, 3, privacy["noise_multiplier"])
        accountant.add_evaluation(10.0)
    assert privacy["epsilon"] == pytest.approx(accountant.epsilon(), rel=1e-9)
    spent = [r["privacy"]["epsilon"] for r in report["rounds"]]
    assert spent == sorted(spent) and spent[-1] == privacy["epsilon"]
    # against the devices (they see who was selected): no amplification, over the most-selected device's rounds
    fleet = [local_epsilon("fixed", privacy["noise_multiplier"], rounds, 1e-3, evaluations=3, eval_noise=10.0)
             for rounds in (1, 3)]
    assert fleet[0] <= privacy["epsilon_fleet"] <= fleet[1]
    assert "dp central: epsilon" in result.stdout
    assert report["data"]["examples"] == 0  # no device said how much data it holds


@pytest.mark.parametrize(("algorithm", "flags"), [
    ("repper", ("--lite-fraction", "0.34")),  # weak devices personalize on the private release
    ("dualfed", ()), ("cd2_pfed", ()), ("fedios", ()), ("lg_fedavg", ()),
])
def test_every_algorithm_dp_supports_runs_privately_end_to_end(tmp_path, mosquitto, algorithm, flags):
    # Execute: 2 rounds under central DP calibrated to epsilon 8
    result = simulate(tmp_path / "run", mosquitto, "--algorithm", algorithm, "--rounds", "2", "--dp", "central",
                      "--dp-epsilon", "8", "--dp-evaluation", "outside", *flags)

    # Assert: every round accounted, the budget respected, every device evaluated
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(tmp_path / "run").report.read_text())
    assert [r["privacy"]["epsilon"] > 0 for r in report["rounds"]] == [True, True]
    assert 0.97 * 8 <= report["privacy"]["epsilon"] <= 8
    assert report["final"]["devices_evaluated"] == 6


def test_dp_sgd_devices_report_their_record_level_epsilon(tmp_path, mosquitto):
    # Execute: a BatchNorm-free model, DP-SGD on every trainer
    result = simulate(tmp_path / "run", mosquitto, "--algorithm", "fedrep", "--model", "mlp", "--dp-sgd",
                      "--dp-sgd-noise", "1.0")

    # Assert: every device reported an epsilon, the same for devices of the same data size
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(tmp_path / "run").report.read_text())
    epsilons = [client["dp_sgd_epsilon"] for client in report["final"]["per_client"].values()]
    assert len(epsilons) == 6 and all(e > 0 for e in epsilons)
    assert report["dp_sgd"]["epsilon_max"] == max(epsilons)
    assert all("loss" not in round_ for round_ in report["rounds"])


@pytest.mark.parametrize(("flags", "named"), [
    (("--algorithm", "dc_pfl", "--dp", "central", "--dp-noise", "1"), "dc_pfl uploads class statistics"),
    (("--algorithm", "repper", "--model", "mlp", "--dp-sgd"), "refused for repper: its supervised contrastive loss"),
    (("--algorithm", "fedavg", "--dp-sgd"), "BatchNorm"),
])
def test_a_run_no_mechanism_covers_is_refused_by_name_before_anything_starts(tmp_path, mosquitto, flags, named):
    result = simulate(tmp_path / "run", mosquitto, *flags)

    assert result.returncode != 0
    assert named in result.stderr + result.stdout
    assert not RunFolder(tmp_path / "run").report.exists()
