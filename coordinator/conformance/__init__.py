"""The conformance kit: the coordinator's side of docs/PROTOCOL.md, played against one device.

`edgepfl conformance --broker URL --device-id ID` registers the device, plays a small FedAvg run
with the task it declares and sends it what a coordinator may send, good and bad, section by
section (`sections.py`), and reports PASS, FAIL or SKIP per section of the protocol
(`coordinator.commands.conformance` prints the report). A device written in another language from
the document is checked the same way as the Python clients.
"""
