"""benchmarks/runs.py's run cache: a finished run is reused, and `cached_only` trains nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from coordinator.run.folder import RunFolder

from benchmarks import runs as runs_module


@pytest.fixture(scope="module")
def runs():
    return runs_module


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


# -- the run ledger ------------------------------------------------------------------------------
MACHINE = {"cpu_model": "Test CPU", "cores": 2, "torch": "2.x"}


def finished_folder(runs, cache, config, participants: int = 2) -> None:
    """A finished 3-round run of `config` in `cache`'s folder, with the machine that trained it."""
    folder = cache.folder(config)
    folder.mkdir(parents=True)
    RunFolder(folder).report.write_text(json.dumps(finished_report(3, participants)))
    (folder / runs.MACHINE_FILE).write_text(json.dumps(MACHINE))


def test_a_clean_run_is_recorded_in_the_ledger_and_read_from_it_once_its_folder_is_gone(runs, tmp_path):
    # Prepare: a finished run in a cache with a ledger
    ledger = tmp_path / "ledger"
    config = runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=3, seed=0)
    cache = runs.RunCache(tmp_path / "cache", cached_only=True, ledger=ledger)
    finished_folder(runs, cache, config)

    # Execute: read it, then lose the cache (another machine) and ask again, for 3 and for 5 rounds
    first = cache.run(config)
    shutil.rmtree(tmp_path / "cache")
    elsewhere = runs.RunCache(tmp_path / "cache", cached_only=True, ledger=ledger)
    again = elsewhere.run(config)
    longer = elsewhere.run(config.replace(rounds=5))

    # Assert: the record holds the run's settings (not where it ran), machine and report; the
    # ledger's view is the same run; a longer run is missing (a record cannot be extended)
    entry = json.loads((ledger / f"{cache.folder(config).name}.json").read_text())
    assert entry["report"] == finished_report(3) and entry["machine"] == MACHINE
    assert entry["config"]["algorithm"] == "fedavg" and "out" not in entry["config"] and "broker" not in entry["config"]
    assert again is not None and again.cached and again.personalized() == first.personalized()
    assert again.machine() == first.machine() == "Test CPU, 2 cores, torch 2.x"
    assert longer is None and elsewhere.missing == [cache.folder(config).name]


def test_a_run_that_is_not_a_clean_measurement_is_not_recorded(runs, tmp_path):
    config = runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=3, seed=0)
    cache = runs.RunCache(tmp_path / "cache", cached_only=True, ledger=tmp_path / "ledger")
    finished_folder(runs, cache, config, participants=1)

    assert cache.run(config) is None
    assert not (tmp_path / "ledger").exists() or not list((tmp_path / "ledger").iterdir())


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "a run record is a JSON object"),
    (json.dumps({"run": "x", "config": {}, "machine": None}), "lacks report"),
    (json.dumps({"run": "another-run", "config": {}, "machine": None, "report": finished_report(3)}),
     "records run 'another-run'"),
    (json.dumps({"run": "RUN", "config": {}, "machine": None, "report": {"rounds_completed": "3"}}),
     "report.rounds_completed"),
])
def test_a_malformed_ledger_record_is_refused_naming_its_file(runs, tmp_path, text, reason):
    config = runs.bench_config(algorithm="fedavg", dataset="digits", clients=2, rounds=3, seed=0)
    cache = runs.RunCache(tmp_path / "cache", cached_only=True, ledger=tmp_path / "ledger")
    name = cache.folder(config).name
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / f"{name}.json").write_text(text.replace('"RUN"', json.dumps(name)))

    with pytest.raises(ValueError, match=reason) as refused:
        cache.run(config)
    assert f"{name}.json" in str(refused.value)


def test_a_record_is_not_replaced_by_a_shorter_run_of_the_same_settings(runs, tmp_path):
    ledger = runs.RunLedger(tmp_path)

    wrote_long = ledger.record("run", {}, MACHINE, finished_report(5))
    wrote_short = ledger.record("run", {}, MACHINE, finished_report(3))
    wrote_same = ledger.record("run", {}, MACHINE, finished_report(5))

    assert (wrote_long, wrote_short, wrote_same) == (True, False, False)
    assert ledger.get("run")["report"]["rounds_completed"] == 5


def test_quick_runs_keep_no_ledger_and_the_others_the_committed_one(runs):
    assert runs.ledger_folder(None, quick=True) is None
    assert runs.ledger_folder(None, quick=False) == runs.DEFAULT_LEDGER == "benchmarks/results/ledger"
    assert runs.ledger_folder("none", quick=False) is None
    assert runs.ledger_folder("/elsewhere", quick=True) == "/elsewhere"
