"""CD2-pFed (Shen et al., CVPR 2022), server side: FedAvg of the shared channel slices.

Paper: Sec. 3.2-3.3 and Alg. 1. The global state holds only shared
entries: before round 1 the full parameters (p_0 = 0); after round t the example-weighted mean
of the uploaded shared slices for p_t = p * t / T (Eq. 3; p from round 1 with `ramp=false`),
entry by entry. Personal channels never reach the server. Round t broadcasts that state (the
slices of the last aggregated round) and expects from each device exactly the slices of round t
(`update_spec`), which shrink as p_t grows. The split rule lives in
`edge_sdk.algorithms.cd2_pfed`, shared with the device.
"""

from __future__ import annotations

from edge_sdk.algorithms.cd2_pfed import CD2PFedDevice, personal_fraction, upload_spec
from edge_sdk.algorithms.hyper.cd2_pfed import Hyper as CD2PFedHyper
from edge_sdk.algorithms.torch_device import SHARED
from edge_sdk.params import ArraySpec

from .base import ServerContext
from .part_sharing import PartSharingServer


class CD2PFedServer(PartSharingServer):
    id = "cd2_pfed"
    Hyper = CD2PFedHyper
    device = CD2PFedDevice
    sliced_broadcast = True
    asynchronous = ("its upload holds the channels that the round's personal fraction p_t leaves shared, so an "
                    "update of an older state has other arrays")

    def __init__(self, hyper: CD2PFedHyper, context: ServerContext):
        super().__init__(hyper, context)
        # Full parameter shapes, from the initial state (all entries shared before round 1).
        self.shapes = {key: tuple(value.shape) for key, value in self.state[SHARED].items()}

    def update_spec(self, round_: int) -> dict[str, ArraySpec]:
        fraction = personal_fraction(self.hyper.p, round_, self.context.rounds, self.hyper.ramp)
        return {SHARED: upload_spec(self.shapes, fraction)}

    def shares_body(self) -> bool:
        """The global state holds each layer's shared channels only from round 1 on (p_t > 0): a
        body with personal channels has nothing whole to release, unless `p` is 0."""
        return self.hyper.p == 0 and super().shares_body()


SERVER = CD2PFedServer
