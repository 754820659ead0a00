"""FedPer (Arivazhagan et al., 2019), server side: the example-weighted mean of the body; the
heads stay on the devices."""

from __future__ import annotations

from edge_sdk.algorithms.fedper import FedPerDevice

from .part_sharing import PartSharingServer


class FedPerServer(PartSharingServer):
    id = "fedper"
    device = FedPerDevice
    Hyper = FedPerDevice.Hyper


SERVER = FedPerServer
