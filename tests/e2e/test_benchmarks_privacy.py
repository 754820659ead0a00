"""benchmarks/privacy.py --quick: runs without DP, under central DP at a target epsilon and under local DP,
side by side (`--jobs`), read into the accuracy, central-against-local and cost tables; one of its private
runs trained again, alone, repeats its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def privacy_quick(out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.privacy", "--quick", *flags, "--out", str(out)]
    return subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    """The whole quick plan, once for both tests (seed 3, two runs side by side): its --out folder."""
    out = tmp_path_factory.mktemp("privacy")
    result = privacy_quick(out, "--jobs", "2", "--seeds", "3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_privacy_quick_meets_each_target_epsilon_and_writes_the_tables(quick_run):
    tmp_path = quick_run
    document = json.loads((tmp_path / "privacy.json").read_text())
    assert document["failures"] == [] and document["missing"] == []
    results = document["results"]
    assert set(results) == {"fedavg/off/inf", "fedavg/central/8", "fedrep/off/inf", "fedrep/central/8",
                            "fedavg/local/8"}
    runs = set()
    for key, entry in results.items():
        found = entry["seeds"]["3"]
        runs.add(found["run"])
        report = json.loads((tmp_path / "runs" / found["run"] / "report.json").read_text())
        assert found["personalized"] == report["final"]["personalized_accuracy"]["mean"]
        assert 0 <= found["trainers"] <= 1 and 0 <= found["weak"] <= 1  # the weak devices reported apart
        if entry["mode"] == "off":
            assert report.get("privacy") is None and found["privacy"] is None and entry["noise_multiplier"] is None
            continue
        privacy = report["privacy"]
        assert privacy["mode"] == entry["mode"] and privacy["delta"] == 1e-5
        assert 0 < privacy["epsilon"] <= entry["epsilon"], key  # the target is met, not exceeded
        assert privacy["noise_multiplier"] == entry["noise_multiplier"] > 0  # the calibrated z is the run's
        assert privacy["outside_the_guarantee"] == ["evaluation figures"]
    assert len(runs) == 5  # each epsilon and mode a run of its own, not one cached folder shared
    # local DP calibrates without amplification by sampling: a larger z for the same epsilon
    assert results["fedavg/local/8"]["noise_multiplier"] > results["fedavg/central/8"]["noise_multiplier"]

    costs = document["costs"]
    assert costs["central"]["device_ms"] > 0 and costs["local"]["coordinator_ms"] > 0
    [accountant] = costs["accountant"]  # the accountant timed at the runs' N, m, rounds and z
    assert accountant["epsilon"] == 8.0 and accountant["epsilon_after_rounds"] <= 8.0
    assert accountant["noise_multiplier"] == results["fedavg/central/8"]["noise_multiplier"]
    assert {row["algorithm"] for row in document["cost_rows"]} == {"fedavg", "fedrep"}
    markdown = (tmp_path / "privacy.md").read_text()
    assert "| FedRep | weak |" in markdown and "| FedAvg | global model |" in markdown
    assert "### Central against local DP at epsilon 8" in markdown and "| FedAvg | local |" in markdown
    assert "each epsilon covers training, not the evaluation" in markdown


def test_privacy_quick_repeats_a_private_run_from_its_seed(quick_run, tmp_path):
    # the quick plan's private FedAvg run (trained side by side with another), trained afresh into a
    # cache of its own, alone: the same figures
    result = privacy_quick(tmp_path / "again", "--algorithms", "fedavg", "--epsilons", "8", "--local-algorithms", "",
                           "--seeds", "3", "--timing-repeats", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads((out / "privacy.json").read_text())["results"]["fedavg/central/8"]
            for out in (quick_run, tmp_path / "again")]
    assert (tmp_path / "again" / "runs" / runs[1]["seeds"]["3"]["run"] / "report.json").is_file()  # trained here

    first, again = (entry["seeds"]["3"] for entry in runs)
    assert first["privacy"]["mode"] == "central"
    for field in ("personalized", "trainers", "weak", "global"):  # the noise is drawn from the seed
        assert first[field] == again[field], field
