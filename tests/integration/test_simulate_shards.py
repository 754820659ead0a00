"""`edgepfl simulate --shards K` hosts its shard aggregators: alone (embedded broker) it gives the
unsharded run's global state bit for bit; an aggregator process that dies is logged and its shard
lost; aggregators left to other hosts need --broker and --federation, as devices do, and with
them (a real Mosquitto) the run sums its shards with `edgepfl aggregator` beside it."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config.run_config import RunConfig
from coordinator.hosting.simulate import run_simulation
from coordinator.run.folder import RunFolder
from edge_sdk.config import ConfigError
from saved_runs import checkpoint_at

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# dev000-dev003 fall 2 in each of 2 shards (sha256 of the id, mod 2)
RUN = ["--algorithm", "fedavg", "--dataset", "digits", "--clients", "4", "--rounds", "2", "--seed", "0",
       "--aggregation-dtype", "float64", "--workers", "1", "--registration-timeout", "60", "--quiet"]


def simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "simulate", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=ENV)


def outcome(out: Path) -> tuple[dict, dict]:
    """(report, checkpointed global state) of the run in `out`."""
    return json.loads(RunFolder(out).report.read_text()), checkpoint_at(RunFolder(out).checkpoint).state


def test_simulate_with_two_shards_alone_gives_the_unsharded_global_state(tmp_path):
    # Execute: both on the embedded broker, nothing started by hand
    alone = simulate(*RUN, "--out", str(tmp_path / "alone"))
    sharded = simulate(*RUN, "--shards", "2", "--out", str(tmp_path / "sharded"))

    # Assert
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    _, expected = outcome(tmp_path / "alone")
    report, actual = outcome(tmp_path / "sharded")
    assert [r["participants"] for r in report["rounds"]] == [4, 4]
    assert [r["lost_shards"] for r in report["rounds"]] == [[], []]
    assert report["rejections"] == {}
    registered = {e.get("device") for e in report["event_log"] if e.get("event") == "registered"}
    assert {"aggregator-0", "aggregator-1"} <= registered, registered
    assert set(actual) == set(expected)
    for group, arrays in expected.items():
        assert set(actual[group]) == set(arrays)
        for name, value in arrays.items():
            assert np.array_equal(actual[group][name], value), f"{group}/{name} differs from the unsharded run"


def test_local_aggregators_none_without_a_broker_is_refused_naming_the_flag(tmp_path):
    # Execute
    result = simulate(*RUN, "--shards", "2", "--local-aggregators", "none", "--out", str(tmp_path))

    # Assert: a usage error, before anything started
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--local-aggregators leaves the aggregators of shards 0-1 to other hosts: give --broker" in result.stderr
    assert not RunFolder(tmp_path).report.exists()


@pytest.mark.parametrize("values", [dict(local_aggregators="1", broker="mqtt://127.0.0.1:1"),
                                    dict(local_aggregators="none", federation="elsewhere")],
                         ids=["partial_without_federation", "none_without_broker"])
def test_aggregators_on_other_hosts_need_broker_and_federation(tmp_path, values):
    config = RunConfig.of(clients=4, rounds=1, shards=2, out=str(tmp_path), **values)

    with pytest.raises(ConfigError, match=r"^--local-aggregators leaves the aggregators of shards "
                                          r"(0|0-1) to other hosts: give --broker .* --shard k/2"):
        run_simulation(config)


def test_a_local_aggregator_that_dies_is_logged_and_its_shard_lost(tmp_path, caplog):
    # Prepare: 4 devices, 2 in each shard; shard 1's aggregator is killed once round 1 ended
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=4, rounds=3, seed=0, workers=1, shards=2,
                          min_clients=1, eval_every=3, round_timeout=60, out=str(tmp_path))
    killed = []

    def on_round(record: dict) -> None:
        if record["round"] == 1:
            aggregator = next(p for p in multiprocessing.active_children() if p.name == "aggregator-1")
            aggregator.kill()  # the run's watch reaps it
            killed.append(aggregator.pid)

    # Execute
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
        report = run_simulation(config, on_round=on_round)

    # Assert: rounds 2 and 3 aggregate shard 0 alone, and the death is named with its shard
    assert len(killed) == 1
    rounds = report["rounds"]
    assert [r["lost_shards"] for r in rounds] == [[], [1], [1]]
    assert [r["participants"] for r in rounds] == [4, 2, 2]
    assert "aggregator-1 died with signal SIGKILL" in caplog.text
    assert "its shard's updates are lost from now on" in caplog.text and "shard 1 of 2" in caplog.text
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("aggregator-")]


def test_one_aggregator_here_the_other_by_edgepfl_aggregator(mosquitto, tmp_path):
    # Prepare: shard 1's aggregator as another host would run it
    federation = "split-aggregators"
    aggregator = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "aggregator", "--shard", "1/2", "--broker",
                                   mosquitto.url, "--federation", federation], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=4, rounds=2, seed=0, workers=1, shards=2,
                          local_aggregators="0", broker=mosquitto.url, federation=federation, registration_timeout=60,
                          out=str(tmp_path))

    # Execute
    try:
        report = run_simulation(config)
        output, _ = aggregator.communicate(timeout=60)  # it ends when the run is announced finished
    finally:
        if aggregator.poll() is None:
            aggregator.kill()
            aggregator.wait()

    # Assert: both shards summed every round, each aggregator registered once (none twice: no takeover)
    assert aggregator.returncode == 0, output[-3000:]
    assert "aggregator 1/2: run" in output and "2 partials sent" in output
    assert [r["lost_shards"] for r in report["rounds"]] == [[], []]
    assert [r["participants"] for r in report["rounds"]] == [4, 4]
    joins = [(e["event"], e["device"]) for e in report["event_log"] if str(e.get("device")).startswith("aggregator-")]
    assert sorted(joins) == [("registered", "aggregator-0"), ("registered", "aggregator-1")]


def test_each_local_aggregator_connects_with_its_own_account(tmp_path):
    # Prepare: a fleet's credentials without the aggregators' accounts (broker-config without --shards)
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps({"coordinator": {"username": "coordinator", "password": "c"},
                                       "devices": {f"dev{i:03d}": {"username": f"dev{i:03d}", "password": "d"}
                                                   for i in range(4)}}))
    config = RunConfig.of(clients=4, rounds=1, shards=2, credentials=str(credentials), out=str(tmp_path / "run"))

    # Execute / Assert: refused before any process starts
    with pytest.raises(ConfigError, match=r"credentials file .* has no entry for 'aggregator-0' \(the shard "
                                          r"aggregators connect with their own accounts: `edgepfl broker-config "
                                          r"--shards 2` enrolls them\)"):
        run_simulation(config)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith(("aggregator-", "worker"))]
