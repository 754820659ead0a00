"""What the coordinator hands out in order of registration (FediOS's projection blocks) goes to
the devices it expects (`expected_devices`) in that order, whatever order their HELLOs arrive in:
devices on several hosts register in no particular order, and the run must not depend on it."""

from __future__ import annotations

from coordinator.config.run_config import RunConfig
from coordinator.server import Coordinator
from edge_sdk.channel import Channel
from edge_sdk.protocol import Topics
from test_doubles import Wire

DEVICES = ["dev000", "dev001", "dev002", "dev003"]


def blocks_when_registering(order: list[str], roster: list[str], out) -> dict[str, int]:
    """FediOS's block of each device when their registrations arrive in `order`."""
    config = RunConfig.of(algorithm="fedios", dataset="digits", clients=len(DEVICES), out=str(out))
    coordinator = Coordinator(config, Channel(Wire("coordinator"), Topics("roster")), expected_devices=roster)
    return {client_id: coordinator.welcome(client_id).config["assignment"]["block"] for client_id in order}


def test_blocks_follow_the_roster_whatever_order_the_devices_register_in(tmp_path) -> None:
    # Execute
    in_order = blocks_when_registering(DEVICES, DEVICES, tmp_path / "a")
    reversed_ = blocks_when_registering(DEVICES[::-1], DEVICES, tmp_path / "b")

    # Assert
    assert reversed_ == in_order
    assert [in_order[c] for c in DEVICES] == [1, 2, 3, 4]


def test_without_a_roster_the_blocks_follow_the_registrations(tmp_path) -> None:
    # Execute: the same reversed registrations, no roster
    reversed_ = blocks_when_registering(DEVICES[::-1], [], tmp_path / "c")

    # Assert: what the roster prevents
    assert [reversed_[c] for c in DEVICES] == [4, 3, 2, 1]


def test_dc_pfl_body_models_follow_the_roster_whatever_order_the_devices_register_in(tmp_path) -> None:
    # Prepare: two body architectures, handed out round robin
    config = RunConfig.of(algorithm="dc_pfl", dataset="fmnist", model="cnn28", clients=len(DEVICES),
                          hyper={"body_models": "cnn28,resnet18", "covariance": "diag"}, out=str(tmp_path))
    coordinator = Coordinator(config, Channel(Wire("coordinator"), Topics("roster")), expected_devices=DEVICES)

    # Execute: registrations in reverse order
    models = {client_id: coordinator.welcome(client_id).config["assignment"]["model"] for client_id in DEVICES[::-1]}

    # Assert
    assert [models[c] for c in DEVICES] == ["cnn28", "resnet18", "cnn28", "resnet18"]
