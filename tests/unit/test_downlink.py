"""Downlink codecs, pure: a change encoded against the held state and reconstructed on a device
gives the coordinator's state bit for bit; a device that lacks the base asks for the full state;
a malformed `downlink` or a change of another layout is refused; the refusals name the key."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.rounds.downlink import Downlink, check_downlink_run
from edge_sdk import downlink
from edge_sdk.config import ConfigError
from edge_sdk.downlink import Announced, HeldState
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ValidationError


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"shared": {"w": rng.normal(size=(4, 5)).astype(np.float32), "b": rng.normal(size=5).astype(np.float16),
                       "n": np.array(seed, dtype=np.int64)}}


def _train(round_: int, groups: dict, announced: dict | None) -> Envelope:
    config = {"selected": ["dev000"], **({"downlink": announced} if announced is not None else {})}
    return Envelope(Kind.TRAIN, COORDINATOR, run_id="run", round=round_, groups=groups, config=config)


@pytest.mark.parametrize(("codec", "item", "tolerance"), [("fp16", np.float16, 1e-2), ("int8", np.int8, 5e-2)])
def test_a_change_reconstructs_the_coordinators_state_bit_for_bit(codec, item, tolerance):
    # Prepare
    coordinator, device = Downlink(codec), HeldState()

    # Execute: three rounds, the device reconstructing each TRAIN
    for round_ in (1, 2, 3):
        carried, held, announced = coordinator.prepare(round_, _state(round_))
        full = device.receive(_train(round_, carried, announced))
        assert full is not None

        # Assert: the device trains from the coordinator's held state, close to the real one
        assert downlink.layout(full.groups) == downlink.layout(_state(round_)) and device.groups is not None
        for name, array in held["shared"].items():
            assert array.tobytes() == device.groups["shared"][name].tobytes() == full.groups["shared"][name].tobytes()
        assert np.allclose(held["shared"]["w"], _state(round_)["shared"]["w"], atol=tolerance)
    assert announced == {"codec": codec, "base": 2, "version": 3}
    assert carried["shared"]["w"].dtype == item and carried["shared"]["n"].dtype == np.int64
    assert (codec == "int8") == ("w#scale" in carried["shared"])


def test_the_first_train_and_a_new_layout_go_in_full():
    # Prepare
    coordinator = Downlink("int8")

    # Execute
    first = coordinator.prepare(1, _state(1))
    wider = {"shared": {**_state(2)["shared"], "extra": np.zeros(3, np.float32)}}
    changed = coordinator.prepare(2, wider)

    # Assert
    assert first[2] == {"codec": "full", "version": 1} and first[0]["shared"]["w"].dtype == np.float32
    assert changed[2] == {"codec": "full", "version": 2} and changed[0]["shared"]["extra"].dtype == np.float32


def test_a_device_without_the_base_asks_and_the_full_copy_serves_it():
    # Prepare
    coordinator = Downlink("fp16")
    coordinator.prepare(1, _state(1))
    carried, held, announced = coordinator.prepare(2, _state(2))
    train = _train(2, carried, announced)
    device = HeldState()

    # Execute
    missing = device.receive(train)
    full = device.receive(coordinator.full(train))

    # Assert
    assert missing is None
    assert full is not None and full.msg_id == train.msg_id
    assert full.config["downlink"] == {"codec": "full", "version": 2}
    assert device.version == 2 and device.groups is not None
    assert device.groups["shared"]["w"].tobytes() == held["shared"]["w"].tobytes()


def test_full_leaves_the_train_as_it_is():
    # Execute
    carried, held, announced = Downlink("full").prepare(1, _state(1))

    # Assert
    assert carried is held and announced is None
    assert HeldState().receive(_train(1, carried, None)) is not None


@pytest.mark.parametrize("value", [
    "fp16", {"codec": "gzip", "version": 1}, {"codec": "fp16", "version": 2},
    {"codec": "full", "version": 2, "base": 1}, {"codec": "int8", "version": True, "base": 1}])
def test_a_malformed_downlink_is_refused(value):
    with pytest.raises(ValidationError):
        Announced.of({"downlink": value})


def test_a_change_of_another_layout_is_refused():
    # Prepare
    held = _state(1)
    change = downlink.encode("fp16", {"shared": {"w": held["shared"]["w"]}}, held)

    # Execute, Assert
    with pytest.raises(ValidationError):
        downlink.reconstruct("fp16", change, held)


@pytest.mark.parametrize(("changes", "named"), [
    ({"mode": "async"}, "mode async"), ({"shards": 2}, "shards"), ({"secure_aggregation": True}, "secure_aggregation")])
def test_a_lossy_downlink_is_refused_where_unsupported(tmp_path, changes, named):
    from coordinator.config.run_config import RunConfig

    # Prepare
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, out=str(tmp_path), downlink_codec="fp16",
                          **changes)

    # Execute, Assert
    with pytest.raises(ConfigError, match=f"downlink_codec fp16: {named}"):
        check_downlink_run(config)


def test_an_unknown_downlink_codec_is_refused_by_its_key():
    from coordinator.config.run_config import RunConfig

    with pytest.raises(ConfigError, match="downlink_codec"):
        RunConfig.of(algorithm="fedavg", dataset="digits", downlink_codec="q4")
