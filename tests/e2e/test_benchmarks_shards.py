"""benchmarks/shards.py --quick: alone and with the 2 shard aggregators simulate hosts, the same global state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.brokers import require_mosquitto

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_shards_quick_gives_the_same_state_with_and_without_shards(tmp_path):
    require_mosquitto()
    command = [sys.executable, "-m", "benchmarks.shards", "--quick", "--out", str(tmp_path)]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "shards-quick.json").read_text())
    alone, sharded = document["runs"]
    assert (alone["shards"], sharded["shards"]) == (0, 2)
    assert alone["participants"] == sharded["participants"] == [6, 6]
    assert sharded["lost_shards"] == [[], []]
    assert (alone["aggregators"], sharded["aggregators"]) == ([], ["aggregator-0", "aggregator-1"])
    assert document["comparison"]["bit_identical"] and document["comparison"]["max_abs_difference"] == 0.0
    assert document["wall_time_ratio"] > 0
