"""benchmarks/scale.py --cluster --quick: 30 lightweight devices over three hosts (network
namespaces) with a NATS node each, the coordinator sharding the aggregation over two aggregator
processes on hosts 2 and 3. Skips (fails under CI=true) like the cluster tests when namespaces or
nats-server are unavailable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.hosts import hosts_or_skip
from harness.nats_cluster import nats_binary

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_scale_cluster_quick_every_update_arrives_through_two_aggregators(tmp_path):
    nats_binary()
    with hosts_or_skip(1):  # namespaces can be made here (the benchmark makes its own)
        pass

    command = [sys.executable, "-m", "benchmarks.scale", "--cluster", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "scale-cluster.json").read_text())
    assert data["settings"]["cluster"] is True and data["settings"]["shards"] == 2
    [run] = data["runs"]
    assert "error" not in run, run
    assert run["devices"] == 30 and run["model_params"] == 26122
    assert run["updates_sent"] == 30
    [round_] = run["rounds"]
    assert round_["updates_accepted"] == 30 and round_["all_updates_received"]
    assert not round_["lost_shards"] and round_["lost_updates"] == 0
    assert [a["name"] for a in run["aggregators"]] == ["aggregator-0", "aggregator-1"]
    for aggregator in run["aggregators"]:
        assert "1 partials sent" in aggregator["last_log_line"]
        assert aggregator["peak_rss_bytes"] >= aggregator["rss_registered_bytes"] > 0
    assert [n["name"] for n in run["nats_nodes"]] == ["nats-n1", "nats-n2", "nats-n3"]
    assert all(n["peak_rss_bytes"] > 0 for n in run["nats_nodes"])
    assert data["targets"]["no_update_lost"] is True
    assert "aggregator-1" in (tmp_path / "scale-cluster.md").read_text()
