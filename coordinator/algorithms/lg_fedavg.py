"""LG-FedAvg (Liang et al., 2020), server side: the example-weighted mean of the global head; the
bodies stay on the devices."""

from __future__ import annotations

from edge_sdk.algorithms.lg_fedavg import LGFedAvgDevice

from .part_sharing import PartSharingServer


class LGFedAvgServer(PartSharingServer):
    id = "lg_fedavg"
    device = LGFedAvgDevice
    Hyper = LGFedAvgDevice.Hyper


SERVER = LGFedAvgServer
