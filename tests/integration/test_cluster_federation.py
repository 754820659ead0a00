"""A whole federation on a 3-node NATS cluster: the coordinator on one host, six `edgepfl client`
processes, two on each of the three hosts, each process connected to the node of its own host.

FedAvg on digits in float64 aggregation gives the same global model as the same run over one
Mosquitto, bit for bit; so does the run with its aggregation split over two `edgepfl aggregator`
processes on hosts 2 and 3 (`--shards 2`), each summing the updates of its shard's devices.
Then the node leading the `$MQTT_msgs` stream is SIGKILLed after round 2 (its two devices lose
the broker, with no Last Will: the node that held their wills is gone,
so the coordinator still counts them online) and restarted once round 3 closed on its quorum
without them: the run completes, both devices reconnect to the restarted node, say HELLO and
train again, and every round is aggregated once with at most one update per device.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from collections.abc import Callable

import numpy as np
import pytest

from harness.brokers import Mosquitto
from coordinator.run.folder import RunFolder
from edge_sdk.channel import Channel
from edge_sdk.protocol import Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport
from harness.hosts import Hosts, hosts_or_skip
from harness.nats_cluster import NatsCluster, nats_binary
from saved_runs import checkpoint_at

# JetStream's elections time out on a starved machine (QoS 1 then waits on redeliveries): run alone
pytestmark = [pytest.mark.integration, pytest.mark.alone]
FED = "cluster"
DEVICES = 6
WAIT = 240.0
RUN_WAIT = 600.0
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def host_of(index: int) -> int:
    """dev0 and dev3 on host 1, dev1 and dev4 on host 2, dev2 and dev5 on host 3."""
    return index % 3 + 1


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.cli", *args]


def coordinator_args(url: str, out: Path, rounds: int, *flags: str) -> list[str]:
    """The coordinator's command (-v: its log says who took part in each round and who went
    offline); every round waits for all the devices (a quorum of all of them, up to the round
    timeout), so that a device slowed by a busy machine is not left out of a round, and for 60 s
    for one whose connection dropped (a node can close a connection whose QoS 1 publish it could
    not store in time). A test that means a smaller quorum says `--min-clients` and
    `--quorum-grace` in `flags` (the last one holds)."""
    return cli("-v", "coordinator", "--broker", url, "--federation", FED, "--algorithm", "fedavg", "--dataset",
               "digits", "--clients", str(DEVICES), "--rounds", str(rounds), "--local-epochs", "1", "--seed", "0",
               "--aggregation-dtype", "float64", "--round-timeout", "120", "--min-clients", str(DEVICES),
               "--quorum-grace", "60", "--out", str(out), *flags)


def device_args(url: str, tmp_path: Path, index: int) -> list[str]:
    return cli("-v", "client", "--broker", url, "--federation", FED, "--client-id", f"dev{index}",
               "--dataset", "digits", "--clients", str(DEVICES), "--index", str(index),
               "--state-dir", str(tmp_path / f"dev{index}"),
               "--device", "cpu")


def spawn_logged(start: Callable[..., subprocess.Popen], argv: list[str], log: Path) -> subprocess.Popen:
    """`start(argv)` (subprocess.Popen, or Hosts.spawn on a host) with its output going to `log`."""
    with open(log, "w") as output:
        return start(argv, env=ENV, stdout=output, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, log: Path, timeout: float = WAIT,
           context: Callable[[], str] = lambda: "") -> None:
    """Wait for `process` to end with 0; on a timeout, fail with what its log says (devices run -v)
    and with `context()` (what the rest of the run says)."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"{log.name}: still running after {timeout:.0f} s:\n{log.read_text()[-4000:]}\n{context()}")
    assert process.returncode == 0, f"{log.read_text()[-4000:]}\n{context()}"


def global_state(out: Path) -> dict:
    return checkpoint_at(out / "checkpoint.msgpack").state


def report_of(out: Path) -> dict:
    return json.loads(RunFolder(out).report.read_text())


def evidence(workdir: Path, out: Path) -> str:
    """What a failed assertion on a run shows: each round's record (who took part, was missing or
    refused, which shards were lost) and what the logs in `workdir` say of warnings, errors,
    devices going offline and reconnections."""
    lines = []
    if RunFolder(out).report.exists():
        lines += [f"round {r['round']}: {r['outcome']}, {r['participants']} of {r['selected']}, missing "
                  f"{r['missing']}, refused {r['refused']}, late {r['late']}, lost shards {r['lost_shards']}, "
                  f"rejections {r['rejections']}" for r in report_of(out)["rounds"]]
    marks = (" WARNING ", " ERROR ", "offline", "reconnect", "subscribing again", "round ", "registered")
    for log in sorted(workdir.glob("*.log")):
        noted = [line for line in log.read_text(errors="replace").splitlines() if any(m in line for m in marks)]
        lines += [f"{log.name}: {line}" for line in noted[-20:]]
    return "\n".join(lines)


class Watcher:
    """Follows the coordinator's STATUS and the devices' HELLOs from a host, through node `url`."""

    def __init__(self, hosts: Hosts, host: int, url: str):
        self.transport = MqttTransport(f"{FED}.watcher", MqttSettings(url=url, connect_timeout=60))
        with hosts.inside(host):
            self.transport.connect()
        self.channel = Channel(self.transport, Topics(FED))
        self.transport.subscribe(Topics(FED).broadcast(Kind.STATUS))
        self.transport.subscribe(f"edgepfl/{FED}/up/+/hello")

    def wait_for(self, what: str, accept, timeout: float = WAIT):
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            received = self.channel.receive(remaining)
            if received is not None and accept(received.envelope):
                return received.envelope
        raise AssertionError(f"timed out waiting for {what}")

    def wait_for_round(self, completed: int):
        return self.wait_for(f"{completed} completed rounds",
                             lambda e: e.kind is Kind.STATUS and e.round >= completed)

    def close(self) -> None:
        self.transport.close()


def run_on_mosquitto(tmp_path: Path, rounds: int) -> Path:
    broker = Mosquitto(tmp_path / "mosquitto").start()
    out, processes = tmp_path / "run", []
    try:
        for index in range(DEVICES):
            processes.append(spawn_logged(subprocess.Popen, device_args(broker.url, tmp_path, index),
                                          tmp_path / f"dev{index}.log"))
        coordinator = spawn_logged(subprocess.Popen, coordinator_args(broker.url, out, rounds),
                                   tmp_path / "coordinator.log")
        processes.append(coordinator)
        finish(coordinator, tmp_path / "coordinator.log")
    finally:
        for process in processes:
            process.kill()
            process.wait()
        broker.stop()
    return out


class ClusterRun:
    """Hosts, the NATS cluster and the devices of one federation on them; then the coordinator
    and a watcher, both on host `coordinator_host` and its node."""

    def __init__(self, hosts: Hosts, tmp_path: Path):
        self.hosts, self.tmp_path, self.out = hosts, tmp_path, tmp_path / "run"
        self.nodes = NatsCluster(hosts, tmp_path / "nats").start()
        self.devices = []
        for i in range(DEVICES):
            url = self.nodes.urls[host_of(i) - 1]
            self.devices.append(spawn_logged(partial(hosts.spawn, host_of(i)), device_args(url, tmp_path, i),
                                             tmp_path / f"dev{i}.log"))
        self.watcher: Watcher | None = None
        self.coordinator: subprocess.Popen | None = None
        self.aggregators: list[tuple[subprocess.Popen, Path]] = []

    def start_coordinator(self, rounds: int, *flags: str, coordinator_host: int = 1) -> None:
        url = self.nodes.urls[coordinator_host - 1]
        self.watcher = Watcher(self.hosts, coordinator_host, url)
        self.coordinator = spawn_logged(partial(self.hosts.spawn, coordinator_host),
                                        coordinator_args(url, self.out, rounds, *flags),
                                        self.tmp_path / "coordinator.log")

    def start_aggregators(self, shards: int) -> None:
        """`edgepfl aggregator --shard k/K` on host k + 2 (hosts 2 and 3 for two shards), each on its host's node."""
        for shard in range(shards):
            host = shard % (len(self.nodes.urls) - 1) + 2
            argv = cli("aggregator", "--shard", f"{shard}/{shards}", "--broker", self.nodes.urls[host - 1],
                       "--federation", FED)
            log = self.tmp_path / f"aggregator{shard}.log"
            self.aggregators.append((spawn_logged(partial(self.hosts.spawn, host), argv, log), log))

    def msgs_stream_leader(self) -> int:
        """The node (host) leading `$MQTT_msgs`, where every QoS 1 message is stored first; the
        stream exists once an MQTT client connected (a probe connection makes sure)."""
        probe = MqttTransport(f"{FED}.probe", MqttSettings(url=self.nodes.urls[0], connect_timeout=60))
        with self.hosts.inside(1):
            probe.connect()
        probe.close()
        leader = self.nodes.node(1).stream_leader("$MQTT_msgs")
        assert leader is not None and leader.startswith("n"), f"no leader for $MQTT_msgs: {leader!r}"
        return int(leader[1:])

    def finish(self) -> None:
        # the whole run: alone about 50 s, but a full suite on 2 cores can slow it fivefold; then
        # each device and aggregator ends on the final STATUS, which JetStream delivers at QoS 1
        context = partial(evidence, self.tmp_path, self.out)
        assert self.coordinator is not None, "finish() before start_coordinator()"
        finish(self.coordinator, self.tmp_path / "coordinator.log", timeout=RUN_WAIT, context=context)
        for index, device in enumerate(self.devices):
            finish(device, self.tmp_path / f"dev{index}.log", timeout=WAIT, context=context)
        for aggregator, log in self.aggregators:
            finish(aggregator, log, timeout=WAIT, context=context)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        for aggregator, _ in self.aggregators:
            aggregator.kill()
            aggregator.wait()
        self.nodes.stop()


@pytest.fixture
def hosts():
    nats_binary()
    with hosts_or_skip(3) as made:
        yield made


def assert_same_global_state(expected_run: Path, actual_run: Path) -> None:
    expected, actual = global_state(expected_run), global_state(actual_run)
    assert set(actual) == set(expected)
    for group, arrays in expected.items():
        assert set(actual[group]) == set(arrays)
        for name, value in arrays.items():
            assert np.array_equal(actual[group][name], value), f"{group}/{name} differs from the Mosquitto run"


@pytest.mark.parametrize("shards", [0, 2], ids=["coordinator_aggregates", "two_aggregator_hosts"])
def test_federation_on_the_cluster_equals_one_mosquitto(hosts, tmp_path, shards):
    rounds = 3
    reference = run_on_mosquitto(tmp_path / "mosquitto", rounds)
    run = ClusterRun(hosts, tmp_path / "cluster")
    try:
        run.start_aggregators(shards)
        run.start_coordinator(rounds, "--shards", str(shards))
        run.finish()
    finally:
        run.close()

    report = report_of(run.out)
    assert report["rounds_completed"] == rounds
    assert [r["participants"] for r in report["rounds"]] == [DEVICES] * rounds, evidence(run.tmp_path, run.out)
    assert all(not r.get("lost_shards") for r in report["rounds"])
    for _, log in run.aggregators:
        assert f"{rounds} partials sent" in log.read_text()
    assert_same_global_state(reference, run.out)


def test_a_nats_node_killed_and_restarted_mid_run(hosts, tmp_path):
    """The node killed is the leader of `$MQTT_msgs` (the coordinator is on another one): for the
    seconds JetStream needs to elect a new leader, the other nodes time out QoS 1 publishes (and
    close those connections) and refuse subscriptions, the hardest case for the nodes left."""
    rounds = 6
    run = ClusterRun(hosts, tmp_path)
    killed = run.msgs_stream_leader()
    on_killed = {f"dev{i}" for i in range(DEVICES) if host_of(i) == killed}
    # evaluated only after the last round: an evaluation waits for every device it thinks online
    # up to --round-timeout, and no Last Will tells the coordinator that the killed node's devices are gone;
    # a round closes 30 s after its quorum of 4: round 3 without those devices, and no round leaves out
    # a device that a loaded machine slowed by a few seconds
    run.start_coordinator(rounds, "--min-clients", "4", "--quorum-grace", "30", "--eval-every", str(rounds),
                          coordinator_host=1 if killed != 1 else 2)
    assert run.watcher is not None and run.coordinator is not None
    node = run.nodes.node(killed)
    try:
        run.watcher.wait_for_round(2)
        node.stop(kill=True)
        run.watcher.wait_for_round(3)  # closed on quorum, without the devices of the killed node
        run.coordinator.send_signal(signal.SIGSTOP)  # held until they are back: a slow restart can't outlast the run
        node.start()
        node.wait_healthy()
        hello: set[str] = set()

        def all_back(envelope: Envelope) -> bool:
            """True on the HELLO that completes those of the killed node's devices."""
            if envelope.kind is not Kind.HELLO:
                return False
            hello.add(envelope.sender)
            return on_killed <= hello

        run.watcher.wait_for("HELLOs of the devices on the restarted node", all_back)
        run.coordinator.send_signal(signal.SIGCONT)
        run.finish()
    finally:
        if run.coordinator is not None:
            run.coordinator.send_signal(signal.SIGCONT)
        run.close()

    report = report_of(run.out)
    metrics = [json.loads(line) for line in RunFolder(run.out).metrics.read_text().splitlines()]
    participants = [r["participants"] for r in report["rounds"]]
    assert report["rounds_completed"] == rounds
    assert [m["round"] for m in metrics if m["event"] == "round"] == list(range(1, rounds + 1)), "each round once"
    why = evidence(run.tmp_path, run.out)
    assert participants[:2] == [DEVICES] * 2, f"before the kill:\n{why}"
    assert participants[2] == DEVICES - len(on_killed), f"round 3 closed without the devices of the killed node:\n{why}"
    assert participants[-1] == DEVICES, f"the devices of the restarted node rejoined and trained again:\n{why}"
    assert all(r["participants"] <= r["selected"] <= DEVICES for r in report["rounds"]), "no update applied twice"
    assert on_killed <= set(report["final"]["per_client"])
