"""benchmarks/accuracy.py: runs of earlier invocations join the tables (--merge), never silently mismatched;
the health measure of a final body; the target compared on the seeds both rows ran."""

from __future__ import annotations

import json

import pytest

from benchmarks import accuracy as accuracy_module


@pytest.fixture(scope="module")
def accuracy():
    return accuracy_module


CONFIG = {"dataset": "fmnist", "clients": 20, "rounds": 15, "local_epochs": 1, "batch_size": 32, "lr": 0.05,
          "grad_clip_norm": 0.0, "model": "cnn28", "eval_every": 1, "hyper": {}}


def run_row(algorithm: str, seed: int, mean: float | None, status: str = "ok") -> dict:
    return {"algorithm": algorithm, "setting": "dir0.1@1", "seed": seed, "status": status,
            "personalized_accuracy": {"mean": mean}}


def head_row(algorithm: str, seed: int, lr: float) -> dict:
    return {"algorithm": algorithm, "setting": "dir0.1@1", "seed": seed, "heads": {"MLP": lr, "SVM": lr, "LR": lr},
            "round_of_body": 15, "in_run": lr}


def earlier_document(runs: list[dict], heads: list[dict], **config) -> dict:
    return {"benchmark": "accuracy", "config": {**CONFIG, **config}, "runs": runs, "heads": {"runs": heads},
            "machine": {"date": "2026-11-22T02:06:36+00:00", "command": "python benchmarks/accuracy.py --seeds 0"}}


def test_merged_seeds_make_mean_and_std_and_this_invocation_wins(accuracy):
    ours = [run_row("fedavg", 1, 0.88), run_row("fedavg", 2, 0.86)]
    earlier = earlier_document([run_row("fedavg", 0, 0.87), run_row("fedavg", 1, 0.10), run_row("fedrep", 0, 0.93),
                                run_row("fedper", 0, None, status="failed")],
                               [head_row("fedavg", 0, 0.96), head_row("fedavg", 1, 0.10)])

    rows, head_runs, sources = accuracy.merge_runs(ours, [head_row("fedavg", 1, 0.97)], {"seed0.json": earlier})

    cells = accuracy.table(rows)["dir0.1@1"]
    assert cells["fedavg"]["n"] == 3 and cells["fedavg"]["mean"] == pytest.approx(0.87)  # its seed 1 lost to ours
    assert cells["fedavg"]["seeds"] == [0, 1, 2] and cells["fedrep"]["seeds"] == [0]
    assert cells["fedavg"]["std"] == pytest.approx((2 / 3) ** 0.5 / 100)
    assert cells["fedrep"]["n"] == 1 and "fedper" not in cells  # failed rows do not join
    assert [r.get("merged_from") for r in rows] == [None, None, "seed0.json", "seed0.json"]
    heads = accuracy.heads_table(head_runs)["table"]["dir0.1@1"]["fedavg"]["LR"]
    assert heads["n"] == 2 and heads["mean"] == pytest.approx(0.965)
    assert sources == [{"file": "seed0.json", "date": "2026-11-22T02:06:36+00:00",
                        "command": "python benchmarks/accuracy.py --seeds 0",
                        "runs": [["fedavg", "dir0.1@1", 0], ["fedrep", "dir0.1@1", 0]],
                        "head_runs": [["fedavg", "dir0.1@1", 0]]}]


def test_a_run_this_invocation_lacks_is_taken_from_the_earlier_file(accuracy):
    ours = [run_row("repper", 0, None, status="not in cache"), run_row("repper", 1, None, status="failed")]
    earlier = earlier_document([run_row("repper", 0, 0.95), run_row("repper", 1, 0.94)], [])

    rows, _, _ = accuracy.merge_runs(ours, [], {"old.json": earlier})

    cell = accuracy.table(rows)["dir0.1@1"]["repper"]
    assert cell["n"] == 2 and cell["mean"] == pytest.approx(0.945)


def test_a_file_with_other_training_settings_is_refused_naming_the_key(accuracy, tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(earlier_document([], [], rounds=20)))

    with pytest.raises(SystemExit, match=r"config\.rounds is 20 there and 15 here"):
        accuracy.load_earlier(str(path), {**CONFIG, "seeds": [1]})


def test_runs_with_other_hyperparameters_are_refused_and_a_file_from_before_set_counts_as_defaults(accuracy, tmp_path):
    other, clipped, before = tmp_path / "other.json", tmp_path / "clipped.json", tmp_path / "before.json"
    other.write_text(json.dumps(earlier_document([], [], hyper={"fedrep": {"momentum": "0.5"}})))
    clipped.write_text(json.dumps(earlier_document([], [], grad_clip_norm=5.0)))
    before.write_text(json.dumps({**earlier_document([], []), "config": {
        k: v for k, v in CONFIG.items() if k not in ("hyper", "grad_clip_norm")}}))

    with pytest.raises(SystemExit, match=r"config\.hyper is \{'fedrep': \{'momentum': '0.5'\}\} there and \{\} here"):
        accuracy.load_earlier(str(other), CONFIG)
    with pytest.raises(SystemExit, match=r"config\.grad_clip_norm is 5.0 there and 0.0 here"):
        accuracy.load_earlier(str(clipped), CONFIG)
    assert accuracy.load_earlier(str(before), CONFIG)["benchmark"] == "accuracy"


def test_clipped_runs_are_cached_apart_and_a_bad_norm_is_refused(accuracy):
    setting = accuracy.Setting.parse("shards2@0.2")
    clipped = accuracy.run_config(accuracy.parse_args(["--grad-clip-norm", "5", "--holdout", "0"]), "lg_fedavg",
                                  setting, 1)
    default = accuracy.run_config(accuracy.parse_args(["--holdout", "0"]), "lg_fedavg", setting, 1)

    assert clipped.training.grad_clip_norm == 5.0 and default.training.grad_clip_norm == 0.0
    assert clipped.fingerprint() != default.fingerprint()
    with pytest.raises(SystemExit, match="grad_clip_norm must be zero"):  # the setting's own check, by its key
        accuracy.parse_args(["--grad-clip-norm", "-1"])


def test_runs_sum_in_float64_and_float32_finds_the_runs_cached_before(accuracy, tmp_path):
    setting, cache = accuracy.Setting.parse("dir0.1@0.2"), accuracy.RunCache(tmp_path)

    default, float32 = (accuracy.run_config(accuracy.parse_args([*flags, "--holdout", "0"]), "fedavg", setting, 0)
                        for flags in ([], ["--aggregation-dtype", "float32"]))

    assert default.aggregation.dtype == "float64" and float32.aggregation.dtype == "float32"
    # the folder of FedAvg's seed-0 run in the 15-round table, made with float32 sums
    assert cache.folder(float32).name == "fedavg-fmnist-dir0.1-f0.2-s0-ae9cc4825c8b1a61"
    assert cache.folder(default) != cache.folder(float32)


def test_set_gives_one_algorithm_its_hyperparameters_and_a_run_folder_of_its_own(accuracy):
    args = accuracy.parse_args(["--set", "fedrep.momentum=0.5", "--set", "fedrep.lr=0.01", "--holdout", "0"])
    setting = accuracy.Setting.parse("dir0.1@1")

    fedrep, fedper = (accuracy.run_config(args, a, setting, 0) for a in ("fedrep", "fedper"))
    default = accuracy.run_config(accuracy.parse_args(["--holdout", "0"]), "fedrep", setting, 0)

    assert args.hyper == {"fedrep": {"momentum": "0.5", "lr": "0.01"}}
    assert fedrep.hyper == {"momentum": "0.5", "lr": "0.01"} and fedper.hyper == {}
    assert fedrep.fingerprint() != default.fingerprint()
    assert "Hyperparameters other than the defaults: FedRep momentum=0.5, lr=0.01." in accuracy.hyper_note(args.hyper)


@pytest.mark.parametrize("assignment, message", [
    ("fedrep.momentum", "expected ALGORITHM.KEY=VALUE"),
    ("momentum=0.5", "expected ALGORITHM.KEY=VALUE"),
    ("nope.momentum=0.5", "unknown algorithm 'nope'"),
    ("fedrep.nope=1", "nope"),
    ("fedrep.momentum=2", "momentum"),
])
def test_a_bad_set_is_refused_before_any_run_naming_what_is_wrong(accuracy, assignment, message):
    with pytest.raises(SystemExit, match=message):
        accuracy.parse_args(["--set", assignment])


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read it as JSON"),
    (json.dumps({"benchmark": "communication"}), "not a result of accuracy.py"),
    (json.dumps([1, 2]), "not a result of accuracy.py"),
])
def test_an_unreadable_or_foreign_file_is_refused(accuracy, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)

    with pytest.raises(SystemExit, match=message):
        accuracy.load_earlier(str(path), CONFIG)


def test_the_table_says_which_runs_were_merged_and_names_the_seeds_of_a_cell_with_fewer(accuracy):
    args = accuracy.parse_args(["--settings", "dir0.1@1", "--seeds", "1", "--rounds", "15", "--holdout", "0"])
    rows = [{**run_row("fedavg", 1, 0.88), "curve": [[1, 0.5], [15, 0.88]]},
            {**run_row("fedavg", 0, 0.86), "merged_from": "seed0.json"},
            {**run_row("fedrep", 1, 0.90), "curve": [[1, 0.5], [15, 0.90]]}]
    document = {"config": CONFIG, "runs": rows, "table": accuracy.table(rows), "heads": None, "holdout": None,
                "target": {"description": "target", "evaluated": False, "why": "test"}, "failures": [],
                "merged": [{"file": "seed0.json", "date": "d", "command": "c", "runs": [["fedavg", "dir0.1@1", 0]],
                            "head_runs": []}],
                "machine": {"cores": 2, "ram_gib": 1, "cpu_model": "x", "torch": "t", "load_average_at_start": [0],
                            "command": "c"}}

    text = accuracy.markdown(args, document, [accuracy.Setting.parse("dir0.1@1")], ["fedavg", "fedrep"])

    assert "| method (%) | Dir(0.1), seeds 0, 1 | over FedAvg |" in text and "| FedAvg | 87.00 ± 1.00 | - |" in text
    # fewer seeds than its column's: named, and over FedAvg's seed 1
    assert "| FedRep | 90.00 (seed 1) | +2.00 |" in text
    assert "Merged from `seed0.json` (d, command `c`): runs FedAvg Dir(0.1), C=1 seed 0; 0 heads row(s)." in text
    assert "; 1 merged run(s) from before these were kept are not in it." in text  # the seed-0 row has no curve


def test_varying_fraction_counts_the_feature_dimensions_that_carry_information(accuracy):
    import numpy as np

    rng = np.random.default_rng(0)
    features = np.maximum(rng.normal(size=(50, 8)), 0)
    features[:, :6] = [0.0, 0.0, 0.0, 0.7, 0.7, 0.7]  # dead ReLUs: constant, zero or the bias

    assert accuracy.varying_fraction(features) == 0.25
    assert np.isnan(accuracy.varying_fraction(features[:1]))


def test_the_target_compares_each_row_with_fedavg_on_the_seeds_both_ran(accuracy):
    args = accuracy.parse_args(["--settings", "dir0.1@1", "--rounds", "15", "--holdout", "0"])
    rows = [run_row("fedavg", 0, 0.88), run_row("fedavg", 1, 0.82), run_row("fedavg", 2, 0.83),
            run_row("fedper", 0, 0.96), run_row("fedper", 1, 0.84), run_row("fedper", 2, 0.83),
            run_row("fedrep", 0, 0.93),  # one seed: compared with FedAvg's seed 0 only, not with its mean
            run_row("repper", 0, 0.95), run_row("repper", 1, 0.90), run_row("repper", 2, 0.91),
            run_row("dualfed", 1, 0.50, status="failed")]

    target = accuracy.target_check(args, rows)

    result = target["by_setting"]["dir0.1@1"]
    assert result["fedavg_seeds"] == [0, 1, 2] and result["fedavg"] == pytest.approx(0.8433, abs=1e-4)
    assert result["rows"]["fedrep"]["seeds"] == [0] and result["rows"]["fedrep"]["delta"] == pytest.approx(0.05)
    assert result["rows"]["fedper"]["delta"] == pytest.approx((0.08 + 0.02 + 0.0) / 3)
    assert not result["rows"]["fedper"]["met"] and result["rows"]["repper"]["met"]
    assert result["rows"]["dualfed"] == {"seeds": [], "delta": None, "deltas": [], "met": False}
    assert not result["complete"] and not target["met"]
    cells = [accuracy.target_cell(accuracy.NAMES[a], r, result["fedavg_seeds"]) for a, r in result["rows"].items()]
    assert cells == ["FedPer +3.33 (+8.00, +2.00, +0.00 on seeds 0, 1, 2)", "FedRep +5.00 (seed 0 only)",
                     "RepPer +7.67 (+7.00, +8.00, +8.00 on seeds 0, 1, 2)", "DualFed -"]


def test_a_table_per_participation_fraction_with_points_over_fedavg_and_the_heads_with_their_seeds(accuracy):
    args = accuracy.parse_args(["--settings", "dir0.1@1,domains@1,dir0.1@0.2", "--rounds", "15", "--holdout", "0"])
    settings = [accuracy.Setting.parse(s) for s in ("dir0.1@1", "domains@1", "dir0.1@0.2")]
    runs = [run_row("fedavg", 0, 0.80), run_row("fedavg", 1, 0.90), run_row("fedper", 0, 0.95),
            run_row("fedper", 1, 0.96), {**run_row("fedavg", 0, 0.70), "setting": "domains@1"},
            {**run_row("fedavg", 0, 0.60), "setting": "dir0.1@0.2"},
            {**run_row("fedper", 2, 0.90), "setting": "dir0.1@0.2"}]
    head_runs = [head_row("fedavg", 0, 0.96), {**head_row("fedavg", 1, 0.94), "varying_features": 0.5}]
    document = {"config": CONFIG, "runs": runs, "table": accuracy.table(runs), "heads": accuracy.heads_table(head_runs),
                "holdout": None, "target": {"description": "target", "evaluated": False, "why": "test"},
                "failures": [], "merged": [], "machine": {"cores": 2, "ram_gib": 1, "cpu_model": "x", "torch": "t",
                                                          "load_average_at_start": [0], "command": "c"}}

    lines = accuracy.markdown(args, document, settings, ["fedavg", "fedper"]).splitlines()

    c1 = lines.index("**C=1**")
    assert lines[c1 + 2] == "| method (%) | Dir(0.1), seeds 0, 1 | over FedAvg | domains, seed 0 | over FedAvg |"
    assert lines[c1 + 4] == "| FedAvg | 85.00 ± 5.00 | - | 70.00 | - |"
    assert lines[c1 + 5] == "| FedPer | 95.50 ± 0.50 | +10.50 | - | - |"  # (15 + 6) / 2, seed by seed
    assert lines[c1 + 6].startswith("| *PFLlib, 2,000 rounds (cited)* | FedAvg 85.85, FedPer 97.44,")
    c02 = lines.index("**C=0.2**")
    assert lines[c02 + 2] == "| method (%) | Dir(0.1), seeds 0, 2 | over FedAvg |"
    assert lines[c02 + 5] == "| FedPer | 90.00 (seed 2) | - |"  # no seed in common with FedAvg: no difference
    assert ("| FedAvg, Dir(0.1), C=1 | 0, 1 | 95.00 ± 1.00 | 95.00 ± 1.00 | 95.00 ± 1.00 | 95.00 ± 1.00 "
            "| 50.00 |") in lines
