"""Secure aggregation in the README's deployment: `edgepfl broker-config --tls` (accounts, ACLs,
mutual TLS, signing keys), `edgepfl secagg-keys`, Mosquitto, a coordinator and four `edgepfl
client` trainers as separate processes, FedAvg over 3 rounds with every device selected.

One trainer is killed in round 2 once every device has shared its keys, while the others train
(5 local epochs keep them at it for seconds): the round completes with the three survivors' sum,
the lost device's masks removed, and round 3 runs with the three. The test waits on log lines and
the coordinator's retained STATUS, never on the clock.
"""

from __future__ import annotations

import json

import pytest

from harness.brokers import ConfiguredMosquitto, require_mosquitto
from coordinator.brokers.embedded import free_port
from coordinator.run.folder import RunFolder
from deployments import FED, Deployment, Process

pytestmark = pytest.mark.integration

DEVICES = ("cam-01", "cam-02", "cam-03", "cam-04")
VICTIM = "cam-04"


def test_a_secure_deployment_survives_a_device_killed_after_sharing_its_keys(tmp_path):
    # Prepare: the broker and the enrollment, then the coordinator and the four trainers
    require_mosquitto()
    port = free_port()
    deployment = Deployment(tmp_path / "broker", port, devices=DEVICES)
    keys, out, state = tmp_path / "keys", tmp_path / "run", tmp_path / "state"
    Process("secagg-keys", "--devices", ",".join(DEVICES), "--out", str(keys)).finish()
    processes: list[Process] = []
    with ConfiguredMosquitto(tmp_path / "broker" / "mosquitto.conf", port):
        try:
            coordinator = Process("-v", "coordinator", "--broker", deployment.url, "--federation", FED,
                                  "--algorithm", "fedavg", "--dataset", "digits", "--partition", "dirichlet",
                                  "--clients", str(len(DEVICES)), "--rounds", "3", "--fraction", "1",
                                  "--local-epochs", "5", "--min-clients", "3", "--round-timeout", "120",
                                  "--secure-aggregation",
                                  "--credentials", str(tmp_path / "broker" / "credentials.json"),
                                  *deployment.tls("coordinator"), "--out", str(out))
            processes.append(coordinator)
            trainers = {device: deployment.device("client", device, i, state, "--device", "cpu",
                                                  "--secagg-identity", str(keys / f"{device}.key"),
                                                  "--secagg-roster", str(keys / "roster.json"))
                        for i, device in enumerate(DEVICES)}
            processes += trainers.values()

            # Execute: kill the victim once round 2's devices have shared their keys
            coordinator.wait_for_line("round 2: 4 of 4 devices shared their keys")
            trainers[VICTIM].popen.kill()
            coordinator.finish()
        finally:
            for process in processes:
                process.kill()

    # Assert: round 2 unmasked the survivors' sum without the victim; round 3 ran with the three
    report = json.loads(RunFolder(out).report.read_text())
    assert report["rounds_completed"] == 3
    rounds = report["rounds"]
    assert [r["participants"] for r in rounds] == [4, 3, 3], rounds
    assert rounds[1]["secagg"]["dropped"] == [VICTIM] and rounds[1]["secagg"]["failed"] is None
    assert rounds[1]["secagg"]["unmasked"] == 3
    assert sum(report["rejections"].values()) == 0, report["rejections"]
