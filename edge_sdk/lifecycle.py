"""Running a device session to its end, or to the broker's refusal.

A device session reconnects after every lost connection; a broker that will not have the
device (its account refused, its topics denied by the ACL) would be reconnected to forever.
The transport notices and sets `failed`; `run_until_done` stops the session then and raises
the transport's `failure`, one line that names the credentials and the ACL.
"""

from __future__ import annotations

from typing import Any


def run_until_done(session: Any) -> None:
    """Run `session` (a `DeviceSession` over an `MqttTransport`) until its run finishes; raise
    `transport.NotAuthorized` if the broker stopped accepting it."""
    transport = session.channel.transport
    session.run(stop=transport.failed)
    if transport.failure is not None:
        raise transport.failure
