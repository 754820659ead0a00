"""DualFed, server side: Eq. (11), the average of the shared encoder `body` and `global_head`.

The paper and its official code weight the reporting clients equally (`weighting="uniform"`,
the default); `weighting="examples"` weights them by their (capped) number of examples. The
server never holds a projector or a personal head.
"""

from __future__ import annotations

from edge_sdk.algorithms.dualfed import SHARED_PARTS, DualFedDevice, build_network
from edge_sdk.algorithms.torch_device import SHARED, model_partition
from edge_sdk.protocol import ArrayGroup
from edge_sdk.training import state_arrays

from .part_sharing import PartSharingServer


class DualFedServer(PartSharingServer):
    id = "dualfed"
    Hyper = DualFedDevice.Hyper

    def initial_state(self) -> dict[str, ArrayGroup]:
        network = build_network(self.context.model, self.context.task, self.hyper, self.context.seed)
        return {SHARED: state_arrays(network, model_partition(network, SHARED_PARTS).shared)}

    def accumulate(self, client_id, groups, metrics, weight) -> None:
        self._mean.add(groups[SHARED], 1.0 if self.hyper.weighting == "uniform" else weight)


SERVER = DualFedServer
