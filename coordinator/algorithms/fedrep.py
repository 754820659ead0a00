"""FedRep (Collins et al., 2021), server side: the example-weighted mean of the body (Eq. 4); the
heads stay on the devices."""

from __future__ import annotations

from edge_sdk.algorithms.fedrep import FedRepDevice

from .part_sharing import PartSharingServer


class FedRepServer(PartSharingServer):
    id = "fedrep"
    device = FedRepDevice
    Hyper = FedRepDevice.Hyper


SERVER = FedRepServer
