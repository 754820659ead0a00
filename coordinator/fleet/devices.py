"""The coordinator's view of the fleet: who registered, what they are, who is online."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Device:
    client_id: str
    kind: str  # "trainer", "lite" or "aggregator" (a shard aggregator)
    num_examples: int
    online: bool = True
    capabilities: dict | None = None


class DeviceRegistry:
    """Registered devices; liveness comes from HELLO (online) and the Last Will (offline)."""

    def __init__(self) -> None:
        self.devices: dict[str, Device] = {}

    def register(self, client_id: str, kind: str, num_examples: int, capabilities: dict) -> bool:
        """Add or refresh a device; True when it was not known before."""
        new = client_id not in self.devices
        self.devices[client_id] = Device(client_id, kind, num_examples, True, capabilities)
        return new

    def mark_offline(self, client_id: str) -> None:
        if client_id in self.devices:
            self.devices[client_id].online = False

    def online(self, kind: str | None = None) -> list[str]:
        """Online devices of `kind`; without one, every device but the shard aggregators."""
        return sorted(d.client_id for d in self.devices.values()
                      if d.online and (d.kind == kind if kind is not None else d.kind != "aggregator"))

    def kind_of(self, client_id: str) -> str:
        return self.devices[client_id].kind if client_id in self.devices else "unknown"
