"""The same `edgepfl simulate` command run twice gives the same models and figures (float64
aggregation): devices register in index order, and every random draw of a device comes from a
generator of its own seed. So does a benchmark run (benchmarks/runs.py: `bench_config` sums in
float64, two workers, part of the devices per round), which the ablation tables compare."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.run.folder import RunFolder

from benchmarks import runs as runs_module
import side_by_side
from saved_runs import checkpoint_at

pytestmark = pytest.mark.e2e


RUNS = {
    # FediOS hands out projection blocks in registration order (the command)
    "fedios": ["--algorithm", "fedios", "--partition", "domains", "--clients", "4", "--rounds", "2", "--workers", "1"],
    # DualFed draws two augmented views of every batch; two workers interleave their replies
    "dualfed": ["--algorithm", "dualfed", "--partition", "domains", "--clients", "3", "--rounds", "2",
                "--workers", "2"],
}


def final_figures(report: dict) -> dict:
    """Per device: its final personalized and global accuracy."""
    return {cid: {k: v for k, v in m.items() if k in ("accuracy", "global_accuracy")}
            for cid, m in report["final"]["per_client"].items()}


def assert_same_state(first: dict, second: dict) -> None:
    assert set(second) == set(first)
    for group, arrays in first.items():
        assert set(second[group]) == set(arrays), group
        for name, value in arrays.items():
            assert np.array_equal(second[group][name], value), f"{group}/{name} differs between the runs"


def simulate(outs: list[Path], flags: list[str]) -> list[tuple[dict, dict]]:
    """Run `edgepfl simulate` with `flags` into each of `outs`, side by side (each with its own
    embedded broker); per run, (per-device final metrics, checkpoint state)."""
    started = [side_by_side.start([sys.executable, "-m", "coordinator.cli", "simulate", "--dataset", "digits",
                                   "--seed", "0", "--aggregation-dtype", "float64", "--out", str(out), "--quiet",
                                   *flags]) for out in outs]
    results = []
    for out, run in zip(outs, side_by_side.finished(*started, timeout=300), strict=True):
        assert run.returncode == 0, run.stdout + run.stderr
        report = json.loads(RunFolder(out).report.read_text())
        results.append((final_figures(report), checkpoint_at(out / "checkpoint.msgpack").state))
    return results


@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_the_same_command_twice_gives_the_same_models_and_figures(tmp_path, algorithm):
    (first_metrics, first_state), (second_metrics, second_state) = simulate([tmp_path / "first",
                                                                             tmp_path / "second"], RUNS[algorithm])

    assert second_metrics == first_metrics
    assert_same_state(first_state, second_state)


@pytest.fixture(scope="module")
def bench_runs():
    """benchmarks/runs.py, as the benchmark scripts import it."""
    return runs_module


# DC-PFL: its server steps phi per report and calibrates on sampled features; FedAvg: the mean
# of updates that two workers deliver in any order
@pytest.mark.parametrize("algorithm", ["dc_pfl", "fedavg"])
def test_a_benchmark_run_twice_gives_the_same_models_and_figures(bench_runs, tmp_path, algorithm):
    # Prepare: a benchmark-style run (bench_config's defaults: two workers, float64 sums), half the devices a round
    config = bench_runs.bench_config(algorithm=algorithm, dataset="digits", partition="dirichlet", alpha=0.1,
                                     clients=6, fraction=0.5, rounds=2, local_epochs=1, seed=0)

    # Execute: the same settings in two caches
    first, second = (bench_runs.RunCache(tmp_path / name).run(config) for name in ("first", "second"))

    # Assert
    assert first is not None and second is not None, "a benchmark run failed"
    assert final_figures(second.report) == final_figures(first.report)
    assert_same_state(checkpoint_at(first.out / "checkpoint.msgpack").state,
                      checkpoint_at(second.out / "checkpoint.msgpack").state)


def test_a_benchmark_run_extended_by_a_round_is_the_run_made_at_once(bench_runs, tmp_path):
    # Prepare: DualFed recalibrates its personal BatchNorm statistics when it evaluates; stage (b)
    # then trains the global head on features computed with them
    config = bench_runs.bench_config(algorithm="dualfed", dataset="digits", partition="dirichlet", alpha=0.1,
                                     clients=4, rounds=2, local_epochs=1, seed=0)
    extended = bench_runs.RunCache(tmp_path / "extended")
    assert extended.run(config.replace(rounds=1)) is not None

    # Execute: the cache extends the 1-round run (devices restart from their saved state); a 2-round run at once
    longer = extended.run(config)
    at_once = bench_runs.RunCache(tmp_path / "at_once").run(config)

    # Assert
    assert longer is not None and at_once is not None and not longer.cached
    assert final_figures(longer.report) == final_figures(at_once.report)
    assert_same_state(checkpoint_at(longer.out / "checkpoint.msgpack").state,
                      checkpoint_at(at_once.out / "checkpoint.msgpack").state)
