"""The README's deployment with real processes: `edgepfl broker-config --tls` (accounts, ACLs,
mutual TLS, signing keys), Mosquitto, a coordinator, three `edgepfl client` trainers and one
`edgepfl lite-client`, 8 rounds of FedPer with every device selected and the body released.

A trainer killed in round 3 and started again rejoins with its own personal state (its head);
every other round aggregates every update it selected. The coordinator is held (SIGSTOP) from the
kill until the restarted device has said HELLO, so a restart slowed by a busy machine cannot
outlast the run; the test waits on the coordinator's retained STATUS and on the devices' log
lines, never on the clock.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from brokers import ConfiguredMosquitto, require_mosquitto
from coordinator.broker import free_port
from coordinator.run_folder import RunFolder
from edge_sdk.channel import Channel
from edge_sdk.protocol import Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

FED = "plant7"
TRAINERS = ("cam-01", "cam-02", "cam-03")
WEAK = "pi-04"
WATCHER = "watcher"  # an account that only reads the retained STATUS
ROUNDS = 8
WAIT = 240.0


class Process:
    """A CLI process whose output lines are read on a thread into a queue, to be waited on."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_line(self, text: str, timeout: float = WAIT) -> str:
        """Block until an output line contains `text`; fail at the timeout."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout:.0f} s:\n{''.join(self.output)[-3000:]}")

    def finish(self, timeout: float = WAIT) -> str:
        self.popen.wait(timeout=timeout)
        text = "".join(self.output)
        assert self.popen.returncode == 0, text[-3000:]
        return text

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
            self.popen.wait(timeout=30)


class Deployment:
    """The files `edgepfl broker-config --tls` wrote, and the flags each account runs with."""

    def __init__(self, root: Path, port: int):
        self.root, self.url = root, f"mqtts://127.0.0.1:{port}"
        accounts = ",".join((*TRAINERS, WEAK, WATCHER))
        subprocess.run([sys.executable, "-m", "coordinator.cli", "broker-config", "--out", str(root), "--federation",
                        FED, "--devices", accounts, "--port", str(port), "--tls"], check=True, capture_output=True)

    def tls(self, account: str) -> list[str]:
        return ["--ca-file", str(self.root / "tls" / "ca.crt"),
                "--cert-file", str(self.root / "tls" / "clients" / f"{account}.crt"),
                "--key-file", str(self.root / "tls" / "clients" / f"{account}.key")]

    def device(self, command: str, client_id: str, index: int, state: Path, *extra: str) -> Process:
        return Process("-v", command, "--broker", self.url, "--federation", FED, "--client-id", client_id,
                       "--dataset", "digits", "--clients", "4", "--index", str(index), "--partition", "dirichlet",
                       "--credentials", str(self.root / "devices" / f"{client_id}.json"), *self.tls(client_id),
                       "--state-dir", str(state / client_id), *extra)

    def watcher(self) -> MqttTransport:
        entry = json.loads((self.root / "devices" / f"{WATCHER}.json").read_text())
        entry = entry.get("devices", {}).get(WATCHER, entry)
        transport = MqttTransport(f"{FED}.{WATCHER}", MqttSettings(
            url=self.url, username=entry["username"], password=entry["password"],
            ca_file=str(self.root / "tls" / "ca.crt"), cert_file=str(self.root / "tls" / "clients" / f"{WATCHER}.crt"),
            key_file=str(self.root / "tls" / "clients" / f"{WATCHER}.key")))
        transport.connect()
        transport.subscribe(Topics(FED).broadcast(Kind.STATUS))
        return transport


def wait_for_round(channel: Channel, completed: int) -> None:
    """Block until a retained STATUS says `completed` rounds are done."""
    deadline = time.monotonic() + WAIT
    while (remaining := deadline - time.monotonic()) > 0:
        received = channel.receive(remaining)
        if received is not None and received.envelope.kind is Kind.STATUS and received.envelope.round >= completed:
            return
    raise AssertionError(f"round {completed} did not complete within {WAIT:.0f} s")


def test_tls_deployment_aggregates_every_selected_update_and_a_restarted_trainer_keeps_its_state(tmp_path):
    # Prepare: the broker set up as the README says, then the coordinator and the four devices
    require_mosquitto()
    port = free_port()
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
                                  *deployment.tls("coordinator"), "--out", str(out))
            processes.append(coordinator)
            trainers = {cid: deployment.device("client", cid, i, state, "--device", "cpu")
                        for i, cid in enumerate(TRAINERS)}
            weak = deployment.device("lite-client", WEAK, 3, state, "--head", "lr")
            processes += [*trainers.values(), weak]

            # Execute: after round 2, kill cam-02 and start it again, the coordinator held meanwhile
            wait_for_round(Channel(watcher, Topics(FED)), 2)
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
    assert report["final"]["per_client"][WEAK]["kind"] == "lite"
    assert sum(report["rejections"].values()) == 0, report["rejections"]
    assert "Traceback" not in lite_output
