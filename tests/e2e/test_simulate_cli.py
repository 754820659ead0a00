"""`edgepfl simulate` end to end: the command users run, over the embedded amqtt broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator.run.folder import RunFolder

pytestmark = pytest.mark.e2e


def test_simulate_three_rounds_writes_report_metrics_and_curves(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", "fedavg", "--dataset", "digits",
               "--clients", "4", "--rounds", "3", "--workers", "2", "--seed", "1", "--out", str(out), "--quiet"]

    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    assert "personalized accuracy" in result.stdout
    report = json.loads(RunFolder(out).report.read_text())
    for key in ("algorithm", "dataset", "partition", "clients", "rounds_completed", "rounds", "final",
                "communication", "wall_seconds"):
        assert key in report
    assert report["rounds_completed"] == 3
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3]
    assert {"round", "participants", "personalized_accuracy", "bytes_up", "bytes_down", "seconds"} <= set(
        report["rounds"][0])
    assert report["final"]["personalized_accuracy"]["mean"] >= 0.8
    assert {c["kind"] for c in report["final"]["per_client"].values()} == {"trainer"}
    assert report["communication"]["by_kind"]["up"]["train_res"] > 0
    lines = [json.loads(line) for line in RunFolder(out).metrics.read_text().splitlines()]
    assert [line["round"] for line in lines if line["event"] == "round"] == [1, 2, 3]
    assert RunFolder(out).curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 played, 3 aggregated" in result.stdout and "final evaluation       over 4 of 4 devices" in result.stdout


def test_a_rerun_of_a_finished_simulation_says_so_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", "fedavg", "--dataset", "digits",
               "--clients", "2", "--rounds", "1", "--workers", "1", "--seed", "1", "--out", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    written = RunFolder(out).report.read_bytes()

    again = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    assert again.returncode == 0, again.stdout + again.stderr
    run_id = json.loads(written)["run_id"]
    assert f"run {run_id} in {out} already finished all 1 rounds; nothing changed" in again.stdout
    assert RunFolder(out).report.read_bytes() == written


def test_bad_flag_value_names_the_key(tmp_path):
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--fraction", "1.5", "--out", str(tmp_path)]

    result = subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert result.returncode == 2
    assert "fraction" in result.stderr


def test_unknown_hyperparameter_is_rejected_by_name(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('rounds = 1\n[algorithm]\nid = "fedavg"\n[algorithm.fedavg]\nmomentun = 0.5\n')
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--config", str(config), "--out", str(tmp_path)]

    result = subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert result.returncode == 2
    assert "momentun" in result.stderr


USER_PACKAGE = '''
from torch import nn
from edge_sdk.models import split


def tiny_mlp(task):
    return split(nn.Sequential(nn.Linear(task.input_shape[0], 32), nn.ReLU(), nn.Linear(32, task.num_classes)),
                 head="2")
'''


def test_simulate_trains_a_user_model_from_its_import_path_on_a_user_csv(tmp_path):
    # Prepare: a package of the user's on the path, and a CSV with a label column
    from sklearn.datasets import load_wine

    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(USER_PACKAGE)
    wine = load_wine()
    rows = [",".join([*(f"f{i}" for i in range(13)), "label"])]
    rows += [",".join([*(f"{v:.5g}" for v in x), wine.target_names[y]])
             for x, y in zip(wine.data, wine.target, strict=True)]
    (tmp_path / "tabular.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", "fedrep", "--model",
               "mypkg.nets:tiny_mlp", "--data", str(tmp_path / "tabular.csv"), "--clients", "4", "--rounds", "3",
               "--workers", "1", "--out", str(out), "--quiet"]
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])

    # Execute
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})

    # Assert: the run trained the user's model on the user's task
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(out).report.read_text())
    assert report["model"] == "mypkg.nets:tiny_mlp" and report["rounds_completed"] == 3
    assert report["final"]["personalized_accuracy"]["mean"] >= 0.7
    assert len(report["final"]["per_client"]) == 4


def test_simulate_refuses_a_model_that_does_not_resolve_by_name(tmp_path):
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--model", "nosuchpkg.nets:tiny_mlp",
               "--dataset", "wine", "--out", str(tmp_path / "run"), "--quiet"]

    result = subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert result.returncode == 2
    assert "nosuchpkg.nets:tiny_mlp" in result.stderr and "Traceback" not in result.stderr


def test_simulate_takes_devices_offline_and_back_on_a_trace(tmp_path):
    # Prepare: dev001 offline for its first second, every device up to 3x slower than the machine;
    # a quorum of all three, so that the rounds wait for dev001 to be back
    out, trace = tmp_path / "run", tmp_path / "trace.csv"
    trace.write_text("device,offline,online\ndev001,0,1\n")
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", "fedavg", "--dataset", "digits",
               "--clients", "3", "--rounds", "10", "--workers", "1", "--min-clients", "3", "--quorum-grace", "2",
               "--availability", str(trace), "--speed-spread", "3", "--out", str(out), "--quiet"]

    # Execute
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    # Assert: its Last Will reached the coordinator, it registered again and the run went on
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(out).report.read_text())
    assert report["rounds_completed"] == 10
    moves = [(e["event"], e["device"]) for e in report["event_log"] if e["event"] in ("offline", "rejoined")]
    assert moves[:2] == [("offline", "dev001"), ("rejoined", "dev001")], moves
    assert {device for _, device in moves} == {"dev001"}, "only the traced device went offline"
    assert "dev001" in report["final"]["per_client"]


def test_simulate_runs_async_steps_on_a_fleet_that_comes_and_goes(tmp_path):
    # Prepare: FedRep, six devices online 70% of the time, up to 5x slower, three training at once
    out = tmp_path / "run"
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", "fedrep", "--dataset", "digits",
               "--clients", "6", "--rounds", "6", "--workers", "2", "--mode", "async", "--buffer", "3",
               "--concurrency", "3", "--eval-every", "3", "--availability", "random:0.7:6", "--speed-spread", "5",
               "--out", str(out)]

    # Execute
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    # Assert: six steps that folded arrivals (three, more after an evaluation), and the summary of their staleness
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(out).report.read_text())
    assert report["rounds_completed"] == 6
    steps = [r["asynchronous"] for r in report["rounds"]]
    assert all(s["arrivals"] >= 1 for s in steps) and sum(s["arrivals"] for s in steps) >= 6 * 3
    assert report["asynchronous"]["arrivals"] == sum(s["arrivals"] for s in steps)
    assert "asynchronous           6 steps" in result.stdout
