"""Running a device session to its end, or to the broker's refusal.

A device session reconnects after every lost connection; a broker that will not have the
device (its account refused, its topics denied by the ACL) would be reconnected to forever.
The transport notices and sets `failed`; `run_until_done` stops the session then and raises
the transport's `failure`, one line that names the credentials and the ACL.

A device with nobody to talk to says so at INFO (`session.waiting_log`); a user running
`edgepfl client` or `edgepfl lite-client` (`say_waiting`) sees that line without -v.
"""

from __future__ import annotations

import logging
from typing import Any

from .session import waiting_log


def run_until_done(session: Any, *, say_waiting: bool = False) -> None:
    """Run `session` (a `DeviceSession` over an `MqttTransport`) until its run finishes; raise
    `transport.NotAuthorized` if the broker stopped accepting it. `say_waiting` (a device run on
    its own, `edgepfl client` and `lite-client`): show its waiting notices at any log level."""
    if say_waiting and not waiting_log.isEnabledFor(logging.INFO):
        waiting_log.setLevel(logging.INFO)
    transport = session.channel.transport
    session.run(stop=transport.failed)
    if transport.failure is not None:
        raise transport.failure
