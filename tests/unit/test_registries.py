"""The algorithm ids are the device package's algorithm modules; each declares its own device class,
the coordinator's registry agrees with it, and the tables' metadata is declared on each class."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

import coordinator.algorithms as server_registry
import edge_sdk.algorithms as device_registry
import edge_sdk.algorithms.hyper as hyper_registry
from coordinator.algorithms.base import ServerAlgorithm
from coordinator.algorithms.part_sharing import PartSharingServer
from edge_sdk.algorithms.base import DeviceAlgorithm

ALGORITHM_IDS = device_registry.ALGORITHM_IDS
SERVER_INFRASTRUCTURE = {"base", "body_models", "outgoing", "part_sharing"}
"""The coordinator's modules that are not an algorithm's server."""
OWN = ("id", "display_name", "citation", "table_rank")
"""What every device class declares itself, not inherited."""


def test_the_ids_are_the_algorithm_modules_and_every_infrastructure_module_exists():
    modules = {m.name for m in pkgutil.iter_modules(device_registry.__path__)}

    assert set(ALGORITHM_IDS) == modules - device_registry.INFRASTRUCTURE
    assert device_registry.INFRASTRUCTURE <= modules, "an infrastructure name that matches no module hides nothing"
    assert {"fedavg", "repper", "fedios"} <= set(ALGORITHM_IDS)


@pytest.mark.parametrize("algorithm_id", ALGORITHM_IDS)
def test_every_algorithm_module_defines_its_own_device_class_with_its_id(algorithm_id):
    device = importlib.import_module(f"edge_sdk.algorithms.{algorithm_id}").DEVICE

    assert issubclass(device, DeviceAlgorithm)
    assert device.id == algorithm_id
    missing = [name for name in OWN if name not in vars(device)]
    assert not missing, f"{device.__name__} inherits {missing} instead of declaring them"
    assert isinstance(device.display_name, str) and device.display_name
    assert device.citation is None or (isinstance(device.citation, str) and device.citation)
    assert isinstance(device.table_rank, int) and isinstance(device.paper_method, bool)


def test_the_table_order_is_by_unique_rank_with_the_five_papers_methods_marked():
    devices = device_registry.in_table_order()
    ranks = [d.table_rank for d in devices]

    assert sorted(d.id for d in devices) == sorted(ALGORITHM_IDS)
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), f"table ranks not unique: {ranks}"
    assert len({d.display_name for d in devices}) == len(devices), "two algorithms with one display name"
    assert [d.id for d in devices if d.paper_method] == ["repper", "dualfed", "dc_pfl", "cd2_pfed", "fedios"]


def test_every_coordinator_module_is_the_server_of_a_known_algorithm():
    modules = {m.name for m in pkgutil.iter_modules(server_registry.__path__)}

    assert SERVER_INFRASTRUCTURE <= modules
    assert modules - SERVER_INFRASTRUCTURE <= set(ALGORITHM_IDS), "a coordinator module with no device side"


def test_every_hyperparameter_module_belongs_to_a_known_algorithm():
    assert {m.name for m in pkgutil.iter_modules(hyper_registry.__path__)} <= set(ALGORITHM_IDS)


@pytest.mark.parametrize("algorithm_id", ALGORITHM_IDS)
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
