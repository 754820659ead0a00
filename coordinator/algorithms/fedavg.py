"""FedAvg (McMahan et al., 2017), server side: the example-weighted mean of all parameters."""

from __future__ import annotations

from .part_sharing import PartSharingServer


class FedAvgServer(PartSharingServer):
    id = "fedavg"
    shared_parts = ("body", "head")


SERVER = FedAvgServer
