"""The checks of `edgepfl workers` that need no broker: device ranges (and simulate's shard
ranges), the settings comparison with the coordinator's announcement, and a worker's hosting
report."""

from __future__ import annotations

import pytest

from coordinator.cli import build_parser
from coordinator.config.run_config import RunConfig
from coordinator.hosting.device_ranges import describe_indices, parse_devices, parse_shards
from coordinator.hosting.simulate import Hosting
from coordinator.hosting.workers import Footprint, check_settings, settings_mismatch
from edge_sdk.config import ConfigError


def test_ranges_and_single_devices_make_one_ascending_share() -> None:
    assert parse_devices("4-6, 0,9", 10, "--devices") == (0, 4, 5, 6, 9)
    assert describe_indices((0, 4, 5, 6, 9)) == "0, 4-6, 9"


def test_none_is_an_empty_share_only_where_allowed() -> None:
    assert parse_devices("none", 4, "--local-devices", allow_none=True) == ()
    with pytest.raises(ConfigError, match="--devices 'none': 'none' is not a device index"):
        parse_devices("none", 4, "--devices")


def test_shard_ranges_take_all_and_none_and_stay_below_the_shard_count() -> None:
    assert parse_shards("all", 3, "--local-aggregators") == (0, 1, 2)
    assert parse_shards("none", 3, "--local-aggregators") == ()
    assert parse_shards("2,0", 3, "--local-aggregators") == (0, 2)
    with pytest.raises(ConfigError, match=r"--local-aggregators '1-3': shard 3 does not exist; the run has 3 shards "
                                          r"\(--shards\), indices 0-2"):
        parse_shards("1-3", 3, "--local-aggregators")
    with pytest.raises(ConfigError, match="'some' is not a shard index or range; expected .*, or all, or none"):
        parse_shards("some", 3, "--local-aggregators")


def test_a_bad_local_aggregators_is_refused_by_its_key() -> None:
    assert RunConfig.of(shards=2).local_shards == (0, 1)  # the default: all
    assert RunConfig.of().local_shards == ()  # no shards, no aggregator
    assert RunConfig.of(shards=2, local_aggregators="1").local_shards == (1,)
    with pytest.raises(ConfigError, match=r"^local_aggregators '0': shard 0 does not exist; the run has 0 shards "
                                          r"\(--shards\)$"):
        RunConfig.of(local_aggregators="0")


def test_only_simulate_takes_local_aggregators() -> None:
    parser = build_parser()

    assert parser.parse_args(["simulate", "--local-aggregators", "none"]).local_aggregators == "none"
    with pytest.raises(SystemExit):  # `edgepfl workers` hosts devices only
        parser.parse_args(["workers", "--devices", "0", "--local-aggregators", "none"])


def test_the_settings_that_differ_are_named_with_both_values() -> None:
    here = RunConfig.of(alpha=0.1, partition="dirichlet", clients=8)
    there = RunConfig.of(alpha=0.5, partition="dirichlet", clients=8).defining()

    lines = settings_mismatch(here.defining(), {**there, "newer_setting": 1})

    assert lines == ["alpha: 0.1 here, 0.5 at the coordinator", "newer_setting: None here, 1 at the coordinator"]
    with pytest.raises(ConfigError, match="alpha: 0.1 here, 0.5 at the coordinator"):
        check_settings(here, there)
    check_settings(here, here.defining())  # the same settings pass


def test_a_malformed_hosting_report_is_refused() -> None:
    report = Hosting(3, 100, 400)

    assert Hosting.from_bytes(report.to_bytes()) == report
    for data in (b'{"devices": -1, "rss_before": 0, "rss_after": 0}', b"[1, 2, 3]", b'{"devices": 1.5}'):
        with pytest.raises(ValueError, match="malformed hosting report"):
            Hosting.from_bytes(data)


def test_the_footprint_is_the_rss_the_devices_added_over_their_number() -> None:
    footprint = Footprint.of([Hosting(2, 100 << 20, 120 << 20), Hosting(3, 100 << 20, 130 << 20)])

    assert footprint.per_device == (50 << 20) / 5
    assert "5 devices joined in 2 worker processes: RSS 10.0 MiB per device" in footprint.describe()
