"""RepPer (Jing et al., AAAI 2023), server side: Eq. (8), the example-weighted mean of the bodies.

The server holds the global representation model only (`body`, and `projector` when
configured); it never holds a classifier. Stage 2 (personal heads) happens on the devices at
evaluation and sends nothing but metrics up.
"""

from __future__ import annotations

from edge_sdk.algorithms.torch_device import SHARED, model_partition
from edge_sdk.algorithms.repper import RepPerDevice, build_network
from edge_sdk.protocol import ArrayGroup
from edge_sdk.training import state_arrays

from .part_sharing import PartSharingServer


class RepPerServer(PartSharingServer):
    id = "repper"
    Hyper = RepPerDevice.Hyper
    device = RepPerDevice
    releases_representation = True

    def initial_state(self) -> dict[str, ArrayGroup]:
        network = build_network(self.context.model, self.context.task, self.hyper, self.context.seed)
        partition = model_partition(network, RepPerDevice.shared_parts, RepPerDevice.share_statistics)
        return {SHARED: state_arrays(network, partition.shared)}


SERVER = RepPerServer
