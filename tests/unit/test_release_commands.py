"""`edgepfl release list | publish | promote | rollback` on a run folder: what they print and
change, and the one line a command that cannot be carried out ends with."""

from __future__ import annotations

import json

import pytest
from onnx_bodies import dense_body

from coordinator.cli import main
from coordinator.releases.inventory import Inventory
from coordinator.releases.store import ReleaseStore
from edge_sdk.data import BUILTIN_TASKS

TASK = BUILTIN_TASKS["digits"]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    ReleaseStore(run).add(dense_body(TASK, hidden=16, seed=0), {"feature_dim": 16}, {"run_id": "run-a", "round": 3},
                          0.91, "released by run run-a after round 3")
    Inventory(run).record("pi-04", runs=1, runs_sha256="a" * 64, accuracy=0.93, evaluated=1, evaluated_accuracy=0.93,
                          kept=None)
    return run


def test_publish_an_onnx_file_then_stage_it(run_dir, tmp_path, capsys):
    body = tmp_path / "body.onnx"
    body.write_bytes(dense_body(TASK, hidden=32, seed=1))
    assert main(["release", "publish", "--run", str(run_dir), str(body)]) == 0
    assert "release 2" in capsys.readouterr().out
    assert ReleaseStore(run_dir).get(2).metadata["feature_dim"] == 32
    assert main(["release", "promote", "2", "--run", str(run_dir), "--fraction", "0.5"]) == 0
    rollout = ReleaseStore(run_dir).read_state().rollout
    assert rollout is not None and (rollout.candidate, rollout.fraction, rollout.tolerance) == (2, 0.5, 0.01)


def test_publish_another_runs_current_release(run_dir, tmp_path):
    other = tmp_path / "retrained"
    ReleaseStore(other).add(dense_body(TASK, hidden=8, seed=2), {"feature_dim": 8}, {"run_id": "run-b", "round": 9},
                            0.95, "released")
    assert main(["release", "publish", "--run", str(run_dir), str(other)]) == 0
    published = ReleaseStore(run_dir).get(2)
    assert published.sha256 == ReleaseStore(other).get(1).sha256
    assert published.source["run_id"] == "run-b" and published.source["version"] == 1


def test_list_shows_versions_history_and_inventory(run_dir, capsys):
    assert main(["release", "list", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "*1" in out and "0.9100" in out and "pi-04" in out and "0.9300" in out
    assert main(["release", "list", "--run", str(run_dir), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["current"] == 1 and listed["inventory"]["pi-04"]["runs"] == 1


@pytest.mark.parametrize("argv, message", [
    (["release", "promote", "7"], "release 7 does not exist"),
    (["release", "promote", "1"], "already the current one"),
    (["release", "rollback"], "nothing to roll back to"),
])
def test_a_command_that_cannot_be_carried_out_says_why(run_dir, capsys, argv, message):
    assert main([*argv, "--run", str(run_dir)]) == 2
    assert message in capsys.readouterr().err


def test_a_file_onnx_runtime_cannot_load_is_not_published(run_dir, tmp_path, capsys):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    assert main(["release", "publish", "--run", str(run_dir), str(broken)]) == 2
    assert "onnxruntime cannot load" in capsys.readouterr().err
    assert [v.version for v in ReleaseStore(run_dir).versions()] == [1]


def test_serve_refuses_a_folder_without_a_run(tmp_path, capsys):
    assert main(["release", "serve", "--run", str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().err
