"""FedProx (Li et al., 2020), server side: the example-weighted mean of all parameters, as FedAvg
(the proximal term is part of the local objective only)."""

from __future__ import annotations

from edge_sdk.algorithms.fedprox import FedProxDevice

from .part_sharing import PartSharingServer


class FedProxServer(PartSharingServer):
    id = "fedprox"
    device = FedProxDevice
    Hyper = FedProxDevice.Hyper


SERVER = FedProxServer
