"""FedAvg with local head fine-tuning, server side: FedAvg (the example-weighted mean of all
parameters); the fine-tuning happens on the devices only."""

from __future__ import annotations

from edge_sdk.algorithms.fedavg_ft import FedAvgFTDevice

from .part_sharing import PartSharingServer


class FedAvgFTServer(PartSharingServer):
    id = "fedavg_ft"
    device = FedAvgFTDevice
    Hyper = FedAvgFTDevice.Hyper


SERVER = FedAvgFTServer
