"""`edgepfl conformance`: connect as the coordinator, play the sections, report.

The kit needs the coordinator's place on the broker (the `coordinator` account where the broker
has accounts) and, to check seals, the device's signing key. It uses a federation of its own or
one where no coordinator runs: it publishes the retained STATUS and RELEASE a coordinator would.
"""

from __future__ import annotations

from edge_sdk.channel import Channel
from edge_sdk.protocol import COORDINATOR, Kind, Topics
from edge_sdk.signing import Verifier
from edge_sdk.transport import MqttSettings, MqttTransport

from .outcome import Report
from .peer import DevicePeer
from .sections import Conformance, KitSettings

DEFAULT_CHUNK_SIZE = 64 << 10
"""The kit's broadcasts are chunked above 64 KiB, so that a TRAIN of a small model travels in frames."""


def run_kit(mqtt: MqttSettings, federation: str, settings: KitSettings, *,
            chunk_size: int = DEFAULT_CHUNK_SIZE) -> Report:
    """Play every section against `settings.device_id` over the broker `mqtt` names."""
    transport = MqttTransport(f"{federation}.{COORDINATOR}", mqtt)
    verifier = Verifier({settings.device_id: settings.signing_key}) if settings.signing_key is not None else None
    # every kind repeatable: a repeated reply must reach the kit, which judges it (section 6)
    channel = Channel(transport, Topics(federation), chunk_size=chunk_size, repeatable=frozenset(Kind),
                      verifier=verifier)
    transport.connect()
    try:
        return Conformance(DevicePeer(channel, settings.device_id), settings).run_all()
    finally:
        transport.close()
