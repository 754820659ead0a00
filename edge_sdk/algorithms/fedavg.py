"""FedAvg (McMahan et al., 2017): every part is shared; the device deploys the global model.

Up: all parameters (BatchNorm running statistics stay on the device, as everywhere here).
Down: the weighted average of the uploads, weighted by the number of training examples.
"""

from __future__ import annotations

from .part_sharing import PartSharingDevice


class FedAvgDevice(PartSharingDevice):
    id = "fedavg"
    display_name = "FedAvg"
    citation = "McMahan et al. 2017"
    table_rank = 20
    shared_parts = ("body", "head")
    deploys_global_model = True


DEVICE = FedAvgDevice
