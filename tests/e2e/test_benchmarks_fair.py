"""benchmarks/fair.py --quick: the lr search on validation, the common-optimizer and paper tables, end to end,
with its runs side by side (`--jobs`), and the same tables rebuilt from the run ledger alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def run_files(cache: Path, name: str) -> tuple[dict, dict]:
    """(the settings it ran with, its report) of a cached run."""
    folder = cache / name
    return json.loads((folder / "bench_config.json").read_text()), json.loads((folder / "report.json").read_text())


def test_fair_quick_chooses_each_lr_on_validation_and_writes_two_tables(tmp_path):
    command = [sys.executable, "-m", "benchmarks.fair", "--quick", "--jobs", "2", "--out", str(tmp_path),
               "--ledger", str(tmp_path / "ledger")]

    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "fair-digits-2rounds.json").read_text())
    assert document["failures"] == [] and document["config"]["grid"] == [0.01, 0.1]
    methods = document["settings"]["dir0.5@1"]
    assert set(methods) == {"fedavg", "fedrep"}
    names = set()
    for method, entry in methods.items():
        # the lr search: one validation run per lr, common SGD, the test split never scored
        validation = {search["lr"]: search["seeds"]["0"] for search in entry["search"]}
        assert set(validation) == {0.01, 0.1}
        best = max(validation.values())
        assert entry["chosen_lr"] == min(lr for lr, accuracy in validation.items() if accuracy == best)
        for search in entry["search"]:
            settings, report = run_files(tmp_path / "runs", search["runs"]["0"])
            assert (settings["algorithm"], settings["optimizer"], settings["lr"]) == (method, "sgd", search["lr"])
            assert settings["validation_fraction"] == 0.2 and report["evaluated_on"] == "validation"
            names.add(search["runs"]["0"])
        # the common-optimizer test run at the chosen lr, and the paper run at the run lr
        settings, report = run_files(tmp_path / "runs", entry["common"]["runs"]["0"])
        assert (settings["optimizer"], settings["lr"], settings["validation_fraction"]) == ("sgd", entry["chosen_lr"],
                                                                                            0.0)
        assert report["evaluated_on"] == "test"
        assert entry["common"]["seeds"]["0"] == report["final"]["personalized_accuracy"]["mean"]
        settings, report = run_files(tmp_path / "runs", entry["paper"]["runs"]["0"])
        assert (settings["optimizer"], settings["lr"], report["evaluated_on"]) == ("paper", 0.05, "test")
        names |= {entry["common"]["runs"]["0"], entry["paper"]["runs"]["0"]}
    assert len(names) == 8  # every run is one of its own, cached apart
    # each run records the machine that trained it, and the tables name it
    machines = {json.loads((tmp_path / "runs" / name / "machine.json").read_text())["cpu_model"] for name in names}
    assert len(machines) == 1
    markdown = (tmp_path / "fair-digits-2rounds.md").read_text()
    assert "### Common optimizer: SGD, momentum 0.9" in markdown and "### Each paper's optimizer" in markdown
    assert f"(lr {methods['fedrep']['chosen_lr']:g}) |" in markdown
    assert "| FedRep | SGD, run lr, momentum 0.5 |" in markdown
    assert f"Runs trained on: {machines.pop()}, " in markdown and "(8 runs)." in markdown
    assert document["progress"] == {kind: {"done": n, "planned": n} for kind, n in
                                    (("search", 4), ("common", 2), ("paper", 2))}
    assert "**Runs done: 8 of 8** (lr search 4 of 4, common-optimizer test runs 2 of 2" in markdown

    # the ledger: a record per run, named like its cache folder, with its settings, machine and report only
    ledger = {path.stem: json.loads(path.read_text()) for path in (tmp_path / "ledger").glob("*.json")}
    assert set(ledger) == names
    for name, entry in ledger.items():
        assert set(entry) == {"run", "config", "machine", "report"} and entry["run"] == name
        assert entry["report"] == json.loads((tmp_path / "runs" / name / "report.json").read_text())
        assert "out" not in entry["config"] and entry["machine"]["cpu_model"] in markdown

    shutil.rmtree(tmp_path / "runs")  # another machine, a fresh checkout: only the ledger is left
    again = subprocess.run([*command, "--cached-only"], check=False, cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})

    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "fair-digits-2rounds.json").read_text())["settings"] == document["settings"]
    assert (tmp_path / "fair-digits-2rounds.md").read_text().split("Tables made on")[0] == markdown.split(
        "Tables made on")[0]
