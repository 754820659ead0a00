"""The same `edgepfl simulate` command run twice gives the same models and figures (float64
aggregation): devices register in index order, and every random draw of a device comes from a
generator of its own seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.checkpoint import load
from coordinator.run_folder import RunFolder

pytestmark = pytest.mark.e2e

RUNS = {
    # FediOS hands out projection blocks in registration order (the command)
    "fedios": ["--algorithm", "fedios", "--partition", "domains", "--clients", "4", "--rounds", "2", "--workers", "1"],
    # DualFed draws two augmented views of every batch; two workers interleave their replies
    "dualfed": ["--algorithm", "dualfed", "--partition", "domains", "--clients", "3", "--rounds", "2",
                "--workers", "2"],
}


def simulate(out: Path, flags: list[str]) -> tuple[dict, dict]:
    """Run `edgepfl simulate` with `flags` into `out`; (per-device final metrics, checkpoint state)."""
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--dataset", "digits", "--seed", "0",
               "--aggregation-dtype", "float64", "--out", str(out), "--quiet", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(RunFolder(out).report.read_text())
    per_client = {cid: {k: v for k, v in m.items() if k in ("accuracy", "global_accuracy")}
                  for cid, m in report["final"]["per_client"].items()}
    return per_client, load(out / "checkpoint.msgpack").state


@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_the_same_command_twice_gives_the_same_models_and_figures(tmp_path, algorithm):
    first_metrics, first_state = simulate(tmp_path / "first", RUNS[algorithm])

    second_metrics, second_state = simulate(tmp_path / "second", RUNS[algorithm])

    assert second_metrics == first_metrics
    assert set(second_state) == set(first_state)
    for group, arrays in first_state.items():
        assert set(second_state[group]) == set(arrays), group
        for name, value in arrays.items():
            assert np.array_equal(second_state[group][name], value), f"{group}/{name} differs between the runs"
