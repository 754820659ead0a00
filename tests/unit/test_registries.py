"""The device and coordinator registries hold the same algorithm ids, and every id loads."""

from __future__ import annotations

import dataclasses

import pytest

import coordinator.algorithms as server_registry
import edge_sdk.algorithms as device_registry
from coordinator.algorithms.base import ServerAlgorithm
from coordinator.algorithms.part_sharing import PartSharingServer
from edge_sdk.algorithms.base import DeviceAlgorithm

SPEC_IDS = ("local fedavg fedavg_ft fedprox fedper fedrep lg_fedavg repper dualfed dc_pfl cd2_pfed fedios "
            "fedbn fedbabu ditto apfl fedrod fedala fedproto").split()


def test_both_registries_list_the_specified_ids():
    assert sorted(device_registry.ALGORITHM_IDS) == sorted(SPEC_IDS)


@pytest.mark.parametrize("algorithm_id", SPEC_IDS)
def test_each_id_has_a_device_and_a_server_side_that_agree(algorithm_id):
    device = device_registry.load(algorithm_id)
    server = server_registry.load(algorithm_id)

    assert issubclass(device, DeviceAlgorithm) and issubclass(server, ServerAlgorithm)
    assert device.id == server.id == algorithm_id
    assert server.Hyper is device.Hyper, "--set is checked against the server's Hyper, used by the device"
    assert dataclasses.is_dataclass(device.Hyper)


def test_unknown_id_is_rejected_by_name():
    with pytest.raises(ValueError, match="fedsgd"):
        server_registry.load("fedsgd")


@pytest.mark.parametrize("algorithm_id", ["fedavg", "fedavg_ft", "fedprox", "fedper", "fedrep", "lg_fedavg"])
def test_a_pure_part_sharing_server_is_derived_from_its_device(algorithm_id):
    # Execute
    server = server_registry.load(algorithm_id)

    # Assert: the mean of the device's shared parts, one class per id
    assert issubclass(server, PartSharingServer)
    assert server.device is device_registry.load(algorithm_id)
    assert server_registry.load(algorithm_id) is server
