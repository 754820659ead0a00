"""benchmarks/observe.py --quick: round times of the same run with and without `--http` (polled),
and the delays from events to the live page's rows in headless Chromium, over Mosquitto.

In CI (CI=true) a missing Mosquitto or `chromium` is a failure, elsewhere a skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.brokers import require_binary, require_mosquitto

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_observe_quick_measures_the_cost_of_http_and_the_delay_to_the_page(tmp_path):
    # Prepare
    require_mosquitto()
    require_binary("chromium", shutil.which("chromium"))

    # Execute
    command = [sys.executable, "-m", "benchmarks.observe", "--quick", "--workers", "1",  # one torch import
               "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    # Assert: both arms ran the same rounds; the http arm was polled; the ratio is theirs
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "observe.json").read_text())
    assert {"machine", "settings", "cost", "work", "delay"} <= set(data)
    cost = data["cost"]
    assert sorted(run["arm"] for run in cost["runs"]) == ["http", "plain"]
    assert all(len(run["round_seconds"]) == 2 and min(run["round_seconds"]) > 0 for run in cost["runs"])
    plain, http = cost["arms"]["plain"], cost["arms"]["http"]
    assert plain["timed_rounds"] == http["timed_rounds"] == 1
    assert cost["ratio"] == pytest.approx(http["median_round_seconds"] / plain["median_round_seconds"])
    [polled] = [run["polling"] for run in cost["runs"] if run["arm"] == "http"]
    assert polled["polls"] >= 1 and polled["largest_state_bytes"] > 0

    # Assert: the work the live view adds, per event and per poll of each endpoint
    work = data["work"]
    assert work["events_per_round"] == work["devices"] + 4 and work["cpu_us_per_event"] > 0  # start, updates, 3 ends
    assert all(work["polled"][path]["cpu_ms"] > 0 and work["polled"][path]["bytes"] > 0
               for path in ("/state.json", "/metrics"))

    # Assert: every event of the page's run after it went live was shown, a delay each, within the polls' bound
    delay = data["delay"]
    figures = delay["delay"]
    assert delay["poll_ms"] == 1000 and delay["page_fetches"] >= 2
    assert figures["count"] == delay["events_shown"] - delay["events_before_live"] > 0
    assert delay["by_event"]["refused"]["count"] == 2 * 2  # 2 refusing devices, 2 rounds
    assert 0 <= figures["min_ms"] <= figures["median_ms"] <= figures["p95_ms"] <= figures["max_ms"] < 5000
    table = (tmp_path / "observe.md").read_text()
    assert "| arm | runs | timed rounds |" in table and "| events | count | median ms |" in table
    assert "the live view adds at most" in table
