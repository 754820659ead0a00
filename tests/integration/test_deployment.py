"""The README's deployment with real processes: `edgepfl broker-config --tls` (accounts, ACLs,
mutual TLS, signing keys), Mosquitto, a coordinator, three `edgepfl client` trainers and one
`edgepfl lite-client`, 8 rounds of FedPer with every device selected and the body released, the
live view and /metrics read mid-run, the rounds tracked to TensorBoard; then `edgepfl release
serve` answers the weak board, reinstalled after training with no model left.

A trainer killed in round 3 and started again rejoins with its own personal state (its head);
every other round aggregates every update it selected. The coordinator is held (SIGSTOP) from the
kill until the restarted device has said HELLO, so a restart slowed by a busy machine cannot
outlast the run; the test waits on the coordinator's retained STATUS and on the devices' log
lines, never on the clock.
"""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from harness.brokers import ConfiguredMosquitto, require_mosquitto
from coordinator.brokers.embedded import free_port
from coordinator.releases.inventory import Inventory
from coordinator.run.folder import RunFolder
from deployments import FED, TRAINERS, WEAK, Deployment, Process, wait_for_round
from edge_sdk.channel import Channel
from edge_sdk.protocol import Topics

pytestmark = pytest.mark.integration

ROUNDS = 8


def test_tls_deployment_aggregates_every_selected_update_and_a_restarted_trainer_keeps_its_state(tmp_path):
    # Prepare: the broker set up as the README says, then the coordinator and the four devices
    require_mosquitto()
    port, http = free_port(), free_port()
    deployment = Deployment(tmp_path / "broker", port)
    out, state = tmp_path / "run", tmp_path / "state"
    processes: list[Process] = []
    with ConfiguredMosquitto(tmp_path / "broker" / "mosquitto.conf", port):
        watcher = deployment.watcher()
        try:
            coordinator = Process("coordinator", "--broker", deployment.url, "--federation", FED, "--algorithm",
                                  "fedper", "--release", "--dataset", "digits", "--partition", "dirichlet",
                                  "--clients", "4", "--rounds", str(ROUNDS), "--fraction", "1", "--local-epochs", "1",
                                  "--min-clients", "2", "--round-timeout", "120",
                                  "--credentials", str(tmp_path / "broker" / "credentials.json"),
                                  *deployment.tls("coordinator"), "--http", str(http), "--track", "tensorboard",
                                  "--out", str(out))
            processes.append(coordinator)
            trainers = {cid: deployment.device("client", cid, i, state, "--device", "cpu")
                        for i, cid in enumerate(TRAINERS)}
            weak = deployment.device("lite-client", WEAK, 3, state, "--head", "lr")
            processes += [*trainers.values(), weak]

            # Execute: after round 2, kill cam-02 and start it again, the coordinator held meanwhile
            wait_for_round(Channel(watcher, Topics(FED)), 2)
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/state.json", timeout=30) as response:
                live = json.loads(response.read())  # the live view, mid-run
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=30) as response:
                metrics = response.read().decode()  # what Prometheus scrapes
            coordinator.popen.send_signal(signal.SIGSTOP)
            trainers["cam-02"].popen.kill()
            trainers["cam-02"].popen.wait(timeout=30)
            trainers["cam-02"] = restarted = deployment.device("client", "cam-02", 1, state, "--device", "cpu")
            processes.append(restarted)
            restarted.wait_for_line("cam-02: HELLO sent")
            coordinator.popen.send_signal(signal.SIGCONT)
            restored = restarted.wait_for_line("personal state of round")
            coordinator.finish()
            lite_output = weak.finish()

            # After training: the release service answers the weak board, reinstalled (no model left)
            service = Process("-v", "release", "serve", "--run", str(out), "--broker", deployment.url, "--federation",
                              FED, "--credentials", str(tmp_path / "broker" / "credentials.json"),
                              *deployment.tls("coordinator"))
            processes.append(service)
            service.wait_for_line("serving release 1")
            reinstalled = deployment.device("lite-client", WEAK, 3, tmp_path / "reinstalled", "--head", "lr")
            processes.append(reinstalled)
            late = reinstalled.wait_for_line(f"{WEAK}: lr head, accuracy")
            service.wait_for_line(f"{WEAK} evaluated release 1")
        finally:
            watcher.close()
            for process in processes:
                process.kill()

    # Assert: every round aggregated every update it selected (round 3, open when cam-02 was
    # killed, the others'); cam-02 came back with its state
    report = json.loads(RunFolder(out).report.read_text())
    assert report["rounds_completed"] == ROUNDS
    assert all(r["participants"] == r["selected"] for r in report["rounds"] if r["round"] != 3), report["rounds"]
    assert report["rounds"][2]["participants"] >= 2
    assert report["rounds"][-1]["participants"] == 3
    assert "restored" in restored and int(restored.split("round ")[1].split()[0]) >= 2
    assert set(report["final"]["per_client"]) == {*TRAINERS, WEAK}
    assert {d["id"]: d["kind"] for d in live["devices"]} == {**dict.fromkeys(TRAINERS, "trainer"), WEAK: "lite"}
    assert live["run"]["completed"] >= 2 and len(live["rounds"]) == live["run"]["completed"]
    assert f'edgepfl_round{{federation="{FED}"}}' in metrics and "edgepfl_devices_online" in metrics
    # every round's figures in the TensorBoard log, read back with TensorBoard's reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("mb_up")] == list(range(1, ROUNDS + 1))
    assert report["final"]["per_client"][WEAK]["kind"] == "lite"
    assert sum(report["rejections"].values()) == 0, report["rejections"]
    assert "Traceback" not in lite_output
    # the reinstalled board personalized on release 1 from the release service, and is in the inventory
    assert (tmp_path / "reinstalled" / WEAK / f"personalized-{WEAK}.onnx").is_file()
    entry = Inventory(out).devices[WEAK]
    assert entry["runs"] == 1 and entry["accuracy"] == pytest.approx(float(late.split("accuracy ")[1].split()[0]),
                                                                      abs=1e-4)
    assert entry["reported"] > report["event_log"][-1]["time"]
