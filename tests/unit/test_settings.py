"""Unit tests for the settings declarations: sections, generated flags, TOML tables, fingerprints."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.cli import build_parser
from coordinator.config.flags import flag_table
from coordinator.config.run_config import KEYS, SECTIONS, RunConfig, all_settings, build_config
from edge_sdk.config import ConfigError
from edge_sdk.settings import ALL_COMMANDS, BrokerSettings, TrainSettings, settings_of

ROOT = Path(__file__).resolve().parents[2]
CONNECTION_FLAGS = ["--broker", "--federation", "--mqtt-protocol", "--username", "--password", "--ca-file",
                    "--cert-file", "--key-file", "--credentials"]


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _subparser(command: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[command]


def _flags(command: str) -> dict[str, str | None]:
    """flag -> its help text (None without one), for one subcommand."""
    return {option: action.help for action in _subparser(command)._actions for option in action.option_strings}


# -- declarations --------------------------------------------------------------------------


def test_every_setting_of_a_run_is_a_flag_of_simulate_whose_help_shows_its_default():
    # Prepare
    flags = _flags("simulate")

    # Execute / Assert
    for key, (section, item) in KEYS.items():
        if "simulate" not in item.commands:
            continue
        assert item.flag in flags, f"[{section}] {key} has no flag"
        assert item.info.help and f"(default: {item.shown_default})" in (flags[item.flag] or "")


def test_every_flag_of_every_command_has_help():
    for command in ("simulate", "coordinator", "client", "lite-client"):
        missing = [flag for flag, text in _flags(command).items() if not text]
        assert missing == [], f"{command}: {missing}"


def test_connection_flags_are_the_same_on_every_command():
    # Execute
    per_command = {command: {flag: text for flag, text in _flags(command).items() if flag in CONNECTION_FLAGS}
                   for command in ALL_COMMANDS}

    # Assert
    assert all(sorted(flags) == sorted(CONNECTION_FLAGS) for flags in per_command.values())
    assert all(flags == per_command["simulate"] for flags in per_command.values())
    assert "--protocol" not in _flags("client")


def test_release_and_amp_are_switches():
    parser = build_parser()

    assert parser.parse_args(["simulate", "--release", "--amp"]).release is True
    assert parser.parse_args(["simulate", "--no-release"]).release is False
    assert parser.parse_args(["simulate"]).release is None  # not given: the file or the default decides
    assert parser.parse_args(["client", "--client-id", "d", "--amp"]).amp is True


def test_simulate_flags_reach_the_sections():
    # Prepare
    args = build_parser().parse_args(["simulate", "--rounds", "3", "--aggregation", "median", "--workers", "2",
                                      "--mqtt-protocol", "5", "--release"])

    # Execute
    from coordinator.cli import _run_config

    config = _run_config(args)

    # Assert
    assert (config.training.rounds, config.aggregation.rule, config.simulation.workers) == (3, "median", 2)
    assert (config.broker.mqtt_protocol, config.run.release) == ("5", True)


def test_rounds_zero_is_refused_naming_the_key():
    from coordinator.cli import main

    with pytest.raises(ConfigError, match="^rounds must be at least 1"):
        build_config(None, {"rounds": 0}, {})
    assert main(["simulate", "--rounds", "0"]) == 2


def test_help_does_not_import_torch():
    # Execute
    code = "import sys; from coordinator.cli import build_parser; build_parser().format_help(); " \
           "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)

    # Assert
    assert result.stdout.strip() == "False", result.stderr


def test_the_documented_flag_table_is_the_generated_one():
    page = (ROOT / "docs" / "CONFIGURATION.md").read_text()

    assert flag_table() in page, (
        "docs/CONFIGURATION.md's flag table is not coordinator.config.flags.flag_table()'s output; regenerate it with "
        ".venv/bin/python -c \"from coordinator.config.flags import flag_table; print(flag_table(), end='')\"")


# -- TOML ----------------------------------------------------------------------------------


def test_flat_and_sectioned_toml_give_the_same_config(tmp_path):
    # Prepare
    flat = _toml(tmp_path, """
        dataset = "fmnist"
        rounds = 7
        local-epochs = 3
        aggregation = "median"
        federation = "plant7"
        workers = 2
        [algorithm.fedprox]
        mu = 0.01
    """)
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text(textwrap.dedent("""
        [run]
        dataset = "fmnist"
        [training]
        rounds = 7
        local-epochs = 3
        [aggregation]
        aggregation = "median"
        [broker]
        federation = "plant7"
        [simulation]
        workers = 2
        [algorithm.fedprox]
        mu = 0.01
    """))

    # Execute
    from_flat = build_config(flat, {"algorithm": "fedprox"}, {})
    from_sections = build_config(str(sectioned), {"algorithm": "fedprox"}, {})

    # Assert
    assert from_flat == from_sections
    assert (from_flat.run.dataset, from_flat.training.rounds, from_flat.aggregation.rule) == ("fmnist", 7, "median")
    assert from_flat.hyper == {"mu": 0.01}


def test_a_flag_beats_a_section_table(tmp_path):
    path = _toml(tmp_path, "[training]\nrounds = 7\n")

    assert build_config(path, {"rounds": 2}, {}).training.rounds == 2


def test_a_key_in_the_wrong_section_is_named_with_its_section(tmp_path):
    path = _toml(tmp_path, "[training]\nfraction = 0.5\n")

    with pytest.raises(ConfigError, match=r"'fraction' in \[training\].*belongs to \[round\]"):
        build_config(path, {}, {})


def test_an_unknown_key_in_a_section_is_named_with_the_section(tmp_path):
    path = _toml(tmp_path, "[round]\nroundz = 3\n")

    with pytest.raises(ConfigError, match=r"'roundz' in \[round\]"):
        build_config(path, {}, {})


def test_a_task_table_is_passed_through(tmp_path):
    # Prepare
    path = _toml(tmp_path, """
        data = "sensor.npz"
        [task]
        kind = "signal"
        input_shape = [3, 128]
        class_names = ["idle", "walk"]
    """)

    # Execute
    config = build_config(path, {}, {})

    # Assert
    assert config.declared_task == {"kind": "signal", "input_shape": [3, 128], "class_names": ["idle", "walk"]}
    assert (config.run.data, config.run.dataset) == ("sensor.npz", None)


# -- data and model ------------------------------------------------------------------------


def test_data_replaces_dataset_and_both_are_refused_naming_both():
    assert RunConfig.of().run.dataset == "digits"
    assert RunConfig.of(data="mine.npz").run.dataset is None
    assert RunConfig.of().replace(data="mine.npz").run.dataset is None  # the one named replaces the other
    assert RunConfig.of(data="mine.npz").replace(dataset="fmnist").run.data is None
    with pytest.raises(ConfigError, match="dataset.*data"):
        RunConfig.of(dataset="fmnist", data="mine.npz")


@pytest.mark.parametrize("spec", ["auto", "cnn8", "mypkg.nets:tiny_mlp", "nets:Factory.build"])
def test_model_accepts_names_and_import_paths(spec):
    assert build_config(None, {"model": spec}, {}).training.model == spec


@pytest.mark.parametrize("spec", ["mypkg.nets", "my-net", "pkg:", ":attr", "a b"])
def test_a_malformed_model_spec_is_refused_naming_the_key(spec):
    with pytest.raises(ConfigError, match="^model must be"):
        build_config(None, {"model": spec}, {})


def test_weak_devices_with_an_algorithm_that_releases_nothing_are_refused_by_both_keys():
    # Execute / Assert: FedAvg releases nothing unless asked
    with pytest.raises(ConfigError, match=r"lite_fraction 0.5 with algorithm fedavg.*set release"):
        RunConfig.of(algorithm="fedavg", lite_fraction=0.5)
    assert RunConfig.of(algorithm="fedavg", lite_fraction=0.5, release=True).lite_devices == 5
    assert RunConfig.of(algorithm="repper", lite_fraction=0.5).lite_devices == 5


# -- fingerprints --------------------------------------------------------------------------


def test_fingerprints_are_those_of_runs_made_before_the_sections():
    # Prepare: the values were computed with the flat RunConfig of commit b28907c
    non_default = RunConfig.of(
        algorithm="fedprox", dataset="fmnist", partition="dirichlet", alpha=0.3, clients=20, fraction=0.5, rounds=9,
        local_epochs=1, batch_size=64, lr=0.1, model="cnn28", seed=3, holdout_clients=2, aggregation="trimmed_mean",
        trim_fraction=0.1, clip_norm=2.0, adversaries=1, attack="noise", lite_fraction=0.25, head="lr",
        release=True, upload_codec="fp16", grad_clip_norm=1.5, hyper={"mu": 0.01}, out="x", round_timeout=5.0)

    # Execute / Assert
    assert RunConfig().fingerprint() == "70de55c5bbe64c40"
    assert RunConfig.of(dataset="fmnist").fingerprint() == "f8c2476e64519519"
    assert non_default.fingerprint() == "59de2c238e035770"


def test_data_and_a_declared_task_enter_the_fingerprint_only_when_set():
    # Prepare: a named model, so the fingerprint needs no task resolution
    base = RunConfig.of(model="cnn8")

    # Execute
    declared = dataclasses.replace(base, declared_task={"kind": "features"})

    # Assert
    assert "data" in KEYS and KEYS["data"][1].info.defines == "if_set"
    assert declared.fingerprint() != base.fingerprint()


# -- shared sections -----------------------------------------------------------------------


def test_train_settings_are_what_welcome_carries():
    # Prepare
    config = RunConfig.of(dataset="digits", lr=0.1)

    # Execute
    settings = config.welcome_settings()

    # Assert
    assert settings == {"model": "cnn8", "rounds": 5, "local_epochs": 2, "batch_size": 32, "lr": 0.1, "seed": 0,
                        "upload_codec": "fp32"}
    assert TrainSettings(**settings) == dataclasses.replace(config.training, model="cnn8")
    assert config.replace(grad_clip_norm=0.5).welcome_settings()["grad_clip_norm"] == 0.5


def test_keys_are_unique_across_sections():
    keys = [item.key for cls in SECTIONS.values() for item in settings_of(cls)]

    assert len(keys) == len(set(keys)) == len(KEYS)


def test_a_device_connects_with_its_own_account_from_the_credentials(tmp_path):
    # Prepare
    path = tmp_path / "credentials.json"
    path.write_text('{"coordinator": {"username": "c", "password": "pc"},'
                    ' "devices": {"dev001": {"username": "dev001", "password": "p1"}}}')

    # Execute
    settings = BrokerSettings(credentials=str(path)).mqtt_settings("dev001")

    # Assert
    assert (settings.url, settings.username, settings.password) == ("mqtt://127.0.0.1:1883", "dev001", "p1")


def test_device_commands_take_the_data_flags_but_not_the_run_flags():
    client = {item.key for _, item in all_settings() if "client" in item.commands}

    assert {"dataset", "data", "data_dir", "partition", "clients", "seed", "device", "amp"} <= client
    assert not {"algorithm", "rounds", "model", "lr", "workers"} & client


def test_a_device_takes_its_partition_from_the_generated_flags():
    # Prepare
    import numpy as np

    from coordinator.cli import _device_data
    from edge_sdk.data import load_client_data

    args = build_parser().parse_args(["client", "--client-id", "d", "--index", "1", "--clients", "4", "--seed", "2"])

    # Execute
    data = _device_data(args)

    # Assert
    expected = load_client_data("digits", num_clients=4, index=1, partition="iid", seed=2, alpha=0.5,
                                classes_per_client=2, data_dir=None)
    assert np.array_equal(data.train_y, expected.train_y)


def test_a_device_needs_either_index_or_data():
    from coordinator.cli import _device_data

    neither = build_parser().parse_args(["lite-client", "--client-id", "d"])
    both = build_parser().parse_args(["lite-client", "--client-id", "d", "--index", "1", "--data", "x.npz"])

    for args in (neither, both):
        with pytest.raises(SystemExit, match="--index.*--data"):
            _device_data(args)


def test_the_flat_record_of_a_run_leaves_the_password_out():
    config = RunConfig.of(username="coordinator", password="s3cret", rounds=2)

    flat = config.to_flat()

    assert flat["username"] == "coordinator" and flat["rounds"] == 2
    assert "password" not in flat and "s3cret" not in repr(flat)
