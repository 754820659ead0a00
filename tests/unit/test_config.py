"""Unit tests for the run configuration: defaults <- TOML <- flags <- --set, errors name keys."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import cast

import pytest

from coordinator.config.run_config import RunConfig, build_config
from edge_sdk.algorithms.hyper.fedprox import Hyper as FedProxHyper
from edge_sdk.chunks import MAX_CHUNK_SIZE
from edge_sdk.config import ConfigError, from_mapping, load_toml, parse_assignments


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


# -- layering ------------------------------------------------------------------------------


def test_defaults_without_file_or_overrides():
    # Execute
    config = build_config(None, {}, {})

    # Assert
    assert config == RunConfig()
    assert (config.run.algorithm, config.training.rounds, config.training.lr, config.hyper) == ("fedavg", 5, 0.05, {})


def test_toml_then_flags_then_set(tmp_path):
    # Prepare
    path = _toml(tmp_path, """
        rounds = 7
        lr = 0.1
        local-epochs = 3

        [algorithm.fedprox]
        mu = 0.01
        keep = "table"
    """)

    # Execute
    config = build_config(path, {"rounds": 9, "lr": None, "clients": 4, "algorithm": "fedprox"},
                          parse_assignments(["mu=0.5"]))

    # Assert
    assert config.training.rounds == 9  # the flag beats the file
    assert config.training.lr == 0.1  # a flag left at None does not override the file
    assert config.training.local_epochs == 3  # dashed TOML keys work
    assert config.run.clients == 4
    assert config.training.batch_size == RunConfig().training.batch_size  # untouched default
    assert config.hyper == {"mu": "0.5", "keep": "table"}  # --set beats the table


def test_algorithm_table_is_selected_by_the_algorithm(tmp_path):
    # Prepare
    path = _toml(tmp_path, """
        [algorithm.fedprox]
        mu = 0.01
        [algorithm.fedper]
        head_epochs = 2
    """)

    # Execute
    fedper = build_config(path, {"algorithm": "fedper"}, {})
    fedprox = build_config(path, {"algorithm": "fedprox"}, {})
    fedavg = build_config(path, {}, {})

    # Assert
    assert fedper.hyper == {"head_epochs": 2}
    assert fedprox.hyper == {"mu": 0.01}
    assert fedavg.hyper == {}


def test_toml_can_choose_the_algorithm(tmp_path):
    # Prepare: `algorithm` is a flag like any other, so a TOML file may set it
    path = _toml(tmp_path, """
        algorithm = "fedper"
        rounds = 2
    """)

    # Execute
    config = build_config(path, {}, {})

    # Assert
    assert (config.run.algorithm, config.training.rounds, config.hyper) == ("fedper", 2, {})


def test_algorithm_id_next_to_its_tables(tmp_path):
    # Prepare
    path = _toml(tmp_path, """
        [algorithm]
        id = "fedprox"
        [algorithm.fedprox]
        mu = 0.25
        [algorithm.fedper]
        head_epochs = 2
    """)

    # Execute
    config = build_config(path, {}, {})

    # Assert
    assert config.run.algorithm == "fedprox"
    assert config.hyper == {"mu": 0.25}


def test_algorithm_section_must_hold_tables(tmp_path):
    path = _toml(tmp_path, """
        [algorithm]
        mu = 0.01
    """)
    with pytest.raises(ConfigError, match="algorithm"):
        build_config(path, {}, {})


# -- errors name the key -------------------------------------------------------------------


def test_unknown_toml_key_is_named(tmp_path):
    # Prepare
    path = _toml(tmp_path, "roundz = 3\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match="roundz"):
        build_config(path, {}, {})


def test_unknown_set_key_is_named_when_the_coordinator_reads_the_hyperparameters(tmp_path):
    # Prepare
    from coordinator.server import Coordinator
    from edge_sdk.channel import Channel
    from edge_sdk.loopback import LoopbackBroker
    from edge_sdk.protocol import Topics

    channel = Channel(LoopbackBroker().transport("coordinator"), Topics("cfg"))
    unknown = build_config(None, {"out": str(tmp_path / "a")}, parse_assignments(["bogus-key=1"]))
    bad_value = build_config(None, {"out": str(tmp_path / "b"), "algorithm": "fedprox"}, parse_assignments(["mu=lots"]))
    good = build_config(None, {"out": str(tmp_path / "c"), "algorithm": "fedprox"}, parse_assignments(["mu=0.5"]))

    # Execute / Assert
    with pytest.raises(ConfigError, match="bogus_key"):
        Coordinator(unknown, channel)
    with pytest.raises(ConfigError, match="mu"):
        Coordinator(bad_value, channel)
    assert cast(FedProxHyper, Coordinator(good, channel).hyper).mu == 0.5


@pytest.mark.parametrize(
    "line, key",
    [('rounds = "many"', "rounds"), ("lr = [0.1]", "lr"), ('fraction = "half"', "fraction"),
     ('partition = "striped"', "partition"), ("clients = 0", "clients"), ("rounds = 2.5", "rounds")],
)
def test_bad_toml_value_is_named(tmp_path, line, key):
    # Prepare
    path = _toml(tmp_path, line + "\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match=key):
        build_config(path, {}, {})


def test_bad_flag_value_is_named():
    with pytest.raises(ConfigError, match="local_epochs"):
        build_config(None, {"local_epochs": "two"}, {})


def test_boolean_for_an_integer_key_is_rejected(tmp_path):
    # Prepare: `rounds = true` is a typo, not "1 round"
    path = _toml(tmp_path, "rounds = true\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match="rounds"):
        build_config(path, {}, {})


def test_negative_seed_is_rejected_up_front():
    # A negative seed passes RunConfig today, then numpy's SeedSequence refuses it in the middle of
    # the run (client selection, data partition); it must be a configuration error naming `seed`.
    with pytest.raises(ConfigError, match="seed"):
        build_config(None, {"seed": -1}, {})


def test_string_values_from_the_command_line_are_coerced():
    config = build_config(None, {"rounds": "3", "lr": "0.2", "data_dir": "none"}, {})
    assert (config.training.rounds, config.training.lr, config.run.data_dir) == (3, 0.2, None)


@pytest.mark.parametrize("pair", ["lr", "=0.1", "  =x"])
def test_set_without_key_value_is_an_error(pair):
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignments([pair])


def test_typed_hyperparameters_name_the_bad_key():
    # Prepare: what an algorithm's Hyper dataclass looks like
    @dataclasses.dataclass(frozen=True)
    class Hyper:
        mu: float = 0.01
        warmup: int = 0
        variant: str = "in"

    # Execute
    good = from_mapping(Hyper, {"mu": "0.5", "warmup": "2"}, where="[algorithm.x]")

    # Assert
    assert good == Hyper(mu=0.5, warmup=2)
    with pytest.raises(ConfigError, match=r"\[algorithm.x\].mu"):
        from_mapping(Hyper, {"mu": "lots"}, where="[algorithm.x]")
    with pytest.raises(ConfigError, match="nope"):
        from_mapping(Hyper, {"nope": 1}, where="[algorithm.x]")


def test_missing_or_broken_toml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_toml(broken)


# -- fingerprint ---------------------------------------------------------------------------


def test_fingerprint_ignores_rounds_paths_and_broker_but_not_lr():
    # Prepare
    base = RunConfig()

    # Execute
    same = [base.replace(rounds=50), base.replace(out="elsewhere"), base.replace(broker="mqtt://10.0.0.1:1883"),
            base.replace(round_timeout=5.0)]
    different = [base.replace(lr=0.1), base.replace(seed=1), base.replace(algorithm="fedper"),
                 dataclasses.replace(base, hyper={"mu": 0.1})]

    # Assert
    assert all(c.fingerprint() == base.fingerprint() for c in same)
    assert len({c.fingerprint() for c in different} | {base.fingerprint()}) == 5


def test_the_aggregation_dtype_defines_a_run_only_when_not_the_default():
    # float64 sums give other bits than float32 ones; float32 runs cached before the key entered keep their fingerprint
    base = RunConfig()
    assert base.replace(aggregation_dtype="float32").fingerprint() == base.fingerprint()
    assert base.replace(aggregation_dtype="float64").fingerprint() != base.fingerprint()
    assert base.replace(aggregation_dtype="float64").defining()["aggregation_dtype"] == "float64"


def test_the_round_budget_defines_a_run_only_of_an_algorithm_whose_schedule_spans_it():
    # CD2-pFed's p_t = p t / T: a 3-round run cut at round 2 is not the 2-round run, nor may it be extended
    cd2, fedavg = RunConfig.of(algorithm="cd2_pfed", rounds=2), RunConfig.of(algorithm="fedavg", rounds=2)
    assert cd2.replace(rounds=3).fingerprint() != cd2.fingerprint()
    assert fedavg.replace(rounds=3).fingerprint() == fedavg.fingerprint()


def test_fingerprint_resolves_the_auto_model():
    # "auto" and the model it stands for are the same run
    auto = RunConfig.of(dataset="digits", model="auto")
    assert auto.fingerprint() == RunConfig.of(dataset="digits", model=auto.model_name).fingerprint()


@pytest.mark.parametrize("key, value", [("upload_chunk_size", 1024), ("chunk_size", 1 << 30),
                                        ("flow_control_bytes", -1), ("aggregation_dtype", "float16")])
def test_bad_transfer_and_aggregation_settings_are_named(key, value):
    with pytest.raises(ConfigError, match=f"^{key} must be"):
        build_config(None, {key: value}, {})


def test_uploads_travel_whole_and_the_coordinator_reads_under_flow_control_by_default():
    config = build_config(None, {}, {})

    assert config.broker.upload_chunk_size == MAX_CHUNK_SIZE and config.broker.chunk_size == 1 << 20
    transport = config.coordinator_transport("mqtt://127.0.0.1:1883")
    assert transport.incoming.max_bytes == config.broker.flow_control_bytes > 0
