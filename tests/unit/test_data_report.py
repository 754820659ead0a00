"""What the coordinator reports of its devices' data: the HELLO label histograms checked, the
label skew, the report's `data` section and line, and which runs state a partition."""

from __future__ import annotations

import logging

import pytest

from coordinator import cli
from coordinator.config.flags import given
from coordinator.config.run_config import build_config
from coordinator.fleet.devices import Device
from coordinator.run.report_files import checked_label_counts, data_line, data_report, label_skew
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.lite import LiteClient


@pytest.mark.parametrize(("value", "reason"), [
    ([3, 0, 2], None),
    (None, None),
    ([3, 2], "got 2 entries"),
    ("3,0,2", "got str"),
    ([3, -1, 3], "ints >= 0"),
    ([3.0, 0, 2], "ints >= 0"),
    ([True, 2, 2], "ints >= 0"),
    ([3, 0, 3], "sum to 6, not to the 5 examples"),
])
def test_a_label_histogram_is_a_count_per_class_summing_to_the_examples(value, reason):
    counts, why = checked_label_counts(value, examples=5, classes=3)

    if reason is None:
        assert why is None and counts == value
    else:
        assert counts is None and why is not None and reason in why


@pytest.mark.parametrize(("histograms", "skew"), [
    ([[5, 5], [5, 5]], 0.0),  # the same mix everywhere
    ([[10, 0], [0, 10]], 0.5),  # a class each: 1 - 1/2
    ([[6, 2], [2, 6]], 0.25),  # pooled (0.5, 0.5); each device 0.75 / 0.25 away by 0.25
    ([[9, 0, 0], [0, 3, 0], [0, 0, 3]], 2 / 3),  # a class each: 1 - 1/3, whatever the sizes
    ([], None),
])
def test_label_skew_is_the_mean_total_variation_from_the_pooled_labels(histograms, skew):
    assert label_skew(histograms) == (pytest.approx(skew) if skew is not None else None)


def test_the_data_section_counts_devices_examples_and_reported_labels(caplog):
    devices = [
        Device("b", "trainer", 6, capabilities={"label_counts": [6, 0]}),
        Device("a", "lite", 2, capabilities={"label_counts": [1, 1]}),
        Device("c", "trainer", 4, capabilities={}),
        Device("d", "trainer", 3, capabilities={"label_counts": [1, 1, 1]}),  # three classes of two
        Device("aggregator-0", "aggregator", 0, capabilities={}),
    ]

    with caplog.at_level(logging.WARNING, logger="coordinator.run.report_files"):
        data = data_report(devices, classes=2)

    assert {key: value for key, value in data.items() if key != "per_device"} == {
        "devices": 4, "examples": 15, "min_examples": 2, "max_examples": 6, "labels_reported": 2,
        "labels_malformed": 1, "label_counts": [7, 1], "label_skew": pytest.approx((0.5 - 1 / 8 + 1 - 7 / 8) / 2)}
    assert list(data["per_device"]) == ["a", "b", "c", "d"]
    assert data["per_device"]["b"] == {"kind": "trainer", "examples": 6, "labels": [6, 0]}
    assert data["per_device"]["c"] == {"kind": "trainer", "examples": 4, "labels": None}
    assert data["per_device"]["d"]["labels"] is None and "3 entries" in data["per_device"]["d"]["labels_malformed"]
    assert "d: label histogram ignored" in caplog.text
    assert data_line(data) == "4 devices, 15 examples (min 2, max 6), labels reported by 2 (skew 0.25), 1 malformed"


def test_the_data_line_of_devices_that_report_no_labels():
    data = data_report([Device("a", "trainer", 310), Device("b", "trainer", 560)], classes=10)

    assert data_line(data) == "2 devices, 870 examples (min 310, max 560), labels reported by 0"
    assert data_line(data_report([], classes=10)) == "no device registered"


def test_under_secure_aggregation_the_data_section_gives_each_device_s_bound_only():
    devices = [Device("a", "trainer", 512, capabilities={"examples_bucket": 9}),
               Device("b", "lite", 64, capabilities={"examples_bucket": 6})]

    data = data_report(devices, classes=10)

    assert data["per_device"]["a"] == {"kind": "trainer", "examples": None, "examples_at_most": 512, "labels": None}
    assert (data["examples"], data["examples_at_most"], data["min_examples"]) == (0, 576, None)
    assert data_line(data) == ("2 devices, at most 576 examples (each device's count rounded up to a power of "
                               "two), no labels reported")


def test_devices_say_hello_with_their_training_labels(tmp_path):
    data = load_client_data("digits", num_clients=4, index=1, seed=0, partition="dirichlet", alpha=0.5)

    _, trainer = EdgeClient("dev001", data, state_dir=tmp_path).hello()
    _, weak = LiteClient("dev001", data, state_dir=tmp_path).hello()
    _, private = LiteClient("dev001", data, state_dir=tmp_path, share_prototypes=False).hello()
    _, private_trainer = EdgeClient("dev001", data, state_dir=tmp_path, share_label_counts=False).hello()

    assert trainer["label_counts"] == weak["label_counts"] == data.class_counts().tolist()
    assert sum(trainer["label_counts"]) == data.num_train and len(trainer["label_counts"]) == 10
    assert "label_counts" not in private  # a weak device that keeps its class statistics keeps its labels too
    assert "label_counts" not in private_trainer


@pytest.mark.parametrize(("argv", "toml", "partition"), [
    ([], None, None),  # devices hold their own data: the coordinator knows no partition
    (["--partition", "dirichlet"], None, "dirichlet"),
    (["--partition", "iid"], None, "iid"),
    ([], 'partition = "shards"\n', "shards"),
    ([], '[run]\npartition = "dirichlet"\n', "dirichlet"),
    ([], 'rounds = 2\n', None),
])
def test_a_coordinator_states_a_partition_only_when_given_one(tmp_path, argv, toml, partition):
    if toml is not None:
        (tmp_path / "run.toml").write_text(toml)
        argv = [*argv, "--config", str(tmp_path / "run.toml")]
    args = cli.build_parser().parse_args(["coordinator", *argv])
    config = build_config(args.config, given(args, args.setting_keys), {})

    assert cli._given_partition(args, config) == partition
