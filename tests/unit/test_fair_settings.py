"""The fair protocol's run settings: `optimizer` (paper | sgd) with its SGD's momentum and weight
decay, and `validation_fraction` (a held-out share of each device's training data).

How the optimizer setting reaches every algorithm's local phases: test_common_optimizer.py; a
whole validation run that never reads the test split: test_loopback_validation.py.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from builtin_tasks import digits_client
from coordinator.cli import _run_config, build_parser
from coordinator.config.run_config import RunConfig, build_config
from edge_sdk.config import ConfigError


@pytest.fixture(scope="module")
def data():
    return digits_client(0, num_clients=3, partition="dirichlet", seed=0)


def rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in x}


def test_the_held_out_split_is_disjoint_from_the_training_data_and_covers_it(data):
    # Execute
    held = data.holding_out(0.2, seed=11)

    # Assert: the training split is cut in two (digits has no two identical images in one client)
    assert len(rows(data.train_x)) == data.num_train
    assert not rows(held.train_x) & rows(held.test_x)
    assert rows(held.train_x) | rows(held.test_x) == rows(data.train_x)
    assert held.num_test == pytest.approx(0.2 * data.num_train, abs=len(np.unique(data.train_y)))
    assert not rows(held.test_x) & rows(data.test_x) and not rows(held.train_x) & rows(data.test_x)
    # labels follow their images
    lookup = {row.tobytes(): y for row, y in zip(data.train_x, data.train_y, strict=True)}
    assert all(lookup[row.tobytes()] == y for row, y in zip(held.test_x, held.test_y, strict=True))


def test_the_held_out_split_is_the_same_for_the_same_seed_only(data):
    # Execute
    first, again, other = data.holding_out(0.2, seed=11), data.holding_out(0.2, seed=11), data.holding_out(0.2, seed=12)

    # Assert
    np.testing.assert_array_equal(first.test_x, again.test_x)
    np.testing.assert_array_equal(first.train_y, again.train_y)
    assert rows(first.test_x) != rows(other.test_x)


def test_the_fair_settings_come_from_flags_and_toml(tmp_path):
    # Prepare
    args = build_parser().parse_args(["simulate", "--optimizer", "sgd", "--sgd-momentum", "0.5",
                                      "--sgd-weight-decay", "0.001", "--validation-fraction", "0.25"])
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent("""\
        [training]
        optimizer = "sgd"
        validation_fraction = 0.1
        """))

    # Execute
    from_flags = _run_config(args).training
    from_toml = build_config(str(path), {}, {}).training

    # Assert
    assert (from_flags.optimizer, from_flags.sgd_momentum, from_flags.sgd_weight_decay,
            from_flags.validation_fraction) == ("sgd", 0.5, 0.001, 0.25)
    assert (from_toml.optimizer, from_toml.sgd_momentum, from_toml.validation_fraction) == ("sgd", 0.9, 0.1)


@pytest.mark.parametrize(("values", "key"), [
    ({"optimizer": "adam"}, "optimizer"),
    ({"validation_fraction": 1.0}, "validation_fraction"),
    ({"validation_fraction": -0.1}, "validation_fraction"),
])
def test_a_bad_value_names_its_key(values, key):
    with pytest.raises(ConfigError, match=f"^{key} must be"):
        build_config(None, values, {})


@pytest.mark.parametrize("changes", [{"optimizer": "sgd"}, {"optimizer": "sgd", "sgd_momentum": 0.0},
                                     {"optimizer": "sgd", "sgd_weight_decay": 1e-4}, {"validation_fraction": 0.2}])
def test_the_fair_settings_define_a_run_and_go_in_welcome_only_when_not_at_their_default(changes):
    # Prepare
    base = RunConfig.of(model="cnn8")
    sgd = base.replace(optimizer="sgd")

    # Execute
    changed = base.replace(**changes)

    # Assert: the default run keeps its fingerprint and WELCOME; a changed one differs
    assert not {"optimizer", "sgd_momentum", "sgd_weight_decay", "validation_fraction"} & set(base.welcome_settings())
    assert changed.fingerprint() != base.fingerprint()
    if changes != {"optimizer": "sgd"}:
        assert changed.fingerprint() != sgd.fingerprint()
    assert {k: changed.welcome_settings()[k] for k in changes} == changes
