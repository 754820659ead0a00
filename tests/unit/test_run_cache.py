"""benchmarks/_runs.py's run cache: a finished run is reused, and `cached_only` trains nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.run_folder import RunFolder

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def runs():
    return load_benchmark("_runs")


def finished_report(rounds: int, participants: int = 2, rejections: dict | None = None) -> dict:
    record = {"round": rounds, "participants": participants, "selected": 2, "outcome": "complete", "seconds": 1.0,
              "personalized_accuracy": {"mean": 0.9, "std": 0.0, "min": 0.9}, "rejections": rejections or {}}
    return {"rounds_completed": rounds, "rounds": [record],
            "final": {"personalized_accuracy": {"mean": 0.9, "std": 0.0, "min": 0.9}}}


def test_cached_only_reuses_finished_runs_and_lists_the_others_without_training(runs, tmp_path):
    # Prepare: one finished 3-round run in the cache; another setting never run
    cache = runs.RunCache(tmp_path, cached_only=True)
    finished = runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=3, seed=0)
    absent = runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=3, seed=1)
    cache.folder(finished).mkdir(parents=True)
    RunFolder(cache.folder(finished)).report.write_text(json.dumps(finished_report(3)))

    # Execute
    view, nothing = cache.run(finished), cache.run(absent)
    longer = cache.run(runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=5, seed=0))

    # Assert: the finished run as of round 3; the others are missing, not failed, and nothing was started
    assert view is not None and view.cached and view.personalized()["mean"] == 0.9
    assert nothing is None and longer is None
    assert cache.missing == [cache.folder(absent).name, cache.folder(finished).name] and cache.failures == []
    assert not cache.folder(absent).exists()
    assert json.loads(RunFolder(cache.folder(finished)).report.read_text())["rounds_completed"] == 3


def test_fresh_and_cached_only_are_refused_together(runs, tmp_path):
    with pytest.raises(ValueError, match="exclude each other"):
        runs.RunCache(tmp_path, fresh=True, cached_only=True)


@pytest.mark.parametrize("rejections, clean", [({"non_finite": 1}, True), ({}, False), ({"bad_shape": 1}, False)])
def test_a_device_missing_from_a_round_is_a_failed_run_unless_its_training_diverged(runs, tmp_path, rejections,
                                                                                   clean):
    # Prepare: a finished run in which one of the two selected devices' updates did not count
    cache = runs.RunCache(tmp_path, cached_only=True)
    config = runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=3, seed=0)
    cache.folder(config).mkdir(parents=True)
    RunFolder(cache.folder(config)).report.write_text(json.dumps(finished_report(3, 1, rejections)))

    # Execute
    view = cache.run(config)

    # Assert: a diverged device is the algorithm's result, counted; any other gap moves the run aside
    if clean:
        assert view is not None and view.diverged_updates == 1 and cache.folder(config).exists()
    else:
        assert view is None and not cache.folder(config).exists()
        assert len(list(tmp_path.glob(f"{cache.folder(config).name}.failed-*"))) == 1


def test_benchmark_runs_sum_in_float64_and_are_cached_apart_from_float32_runs(runs, tmp_path):
    # Prepare: the same settings as a benchmark run and as a run cached before benchmarks summed in float64
    bench = runs.bench_config(algorithm="dc_pfl", dataset="digits", clients=6, rounds=2, seed=0, fraction=0.5)
    float32 = runs.bench_config(algorithm="dc_pfl", dataset="digits", clients=6, rounds=2, seed=0, fraction=0.5,
                                aggregation_dtype="float32")

    # Execute
    cache = runs.RunCache(tmp_path)

    # Assert: float64 sums (runs repeat bit for bit), and another folder than the float32 run's
    assert bench.aggregation.dtype == "float64"
    assert bench.fingerprint() != float32.fingerprint()
    assert cache.folder(bench) != cache.folder(float32)
