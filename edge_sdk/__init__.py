"""edgepfl's device SDK: the wire contract, the MQTT transport and the trainer client.

`import edge_sdk` needs only the base install (numpy, msgpack, paho-mqtt); torch is imported by
the trainer-side modules that need it, and never by `edge_sdk.lite`.
"""

from .protocol import PROTOCOL_VERSION, Envelope, Kind, Topics

__all__ = ["PROTOCOL_VERSION", "Envelope", "Kind", "Topics"]
__version__ = "0.1.0"
