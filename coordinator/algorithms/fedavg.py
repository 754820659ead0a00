"""FedAvg (McMahan et al., 2017), server side: the example-weighted mean of all parameters."""

from __future__ import annotations

from edge_sdk.algorithms.fedavg import FedAvgDevice

from .part_sharing import PartSharingServer


class FedAvgServer(PartSharingServer):
    id = "fedavg"
    device = FedAvgDevice


SERVER = FedAvgServer
