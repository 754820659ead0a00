"""What a user sees when things go wrong, against real brokers: one line naming the cause and the
fix, exit code 2 for usage errors and 1 for runtime failures, 130 for Ctrl-C, never a traceback,
and nothing left running."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import cast

import psutil
import pytest

from harness.brokers import Mosquitto, require_mosquitto
from ctrl_c import restore_ctrl_c
from coordinator.brokers.embedded import free_port, wait_for_port
from coordinator.brokers.mosquitto import generate
from coordinator.run import checkpoint
from coordinator.run.folder import RunFolder
from edge_sdk.transport import BrokerUnreachable, MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FED = "clifed"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def edgepfl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=ENV)


def assert_one_line_failure(result: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("edgepfl "), result.stderr
    for fragment in fragments:
        assert fragment in last, last


def generated_broker(tmp_path_factory, name: str, *, tls: bool):
    """A Mosquitto started with what `edgepfl broker-config` writes; yields the setup."""
    binary = require_mosquitto()
    port = free_port()
    setup = generate(tmp_path_factory.mktemp(name), FED, ["dev000", "dev001"], port, tls=tls)
    process = subprocess.Popen([binary, "-c", str(setup.config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    if not wait_for_port("127.0.0.1", port, 15):
        process.terminate()
        raise RuntimeError(f"mosquitto did not start with {setup.config}")
    yield setup
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    yield from generated_broker(tmp_path_factory, "plain", tls=False)


@pytest.fixture(scope="module")
def mutual_tls(tmp_path_factory):
    yield from generated_broker(tmp_path_factory, "tls", tls=True)


def device(*args: str) -> list[str]:
    return ["client", "--index", "0", "--clients", "2", "--federation", FED, *args]


def test_connection_refused_is_one_line_naming_the_broker():
    # Prepare
    port = free_port()

    # Execute
    result = edgepfl(*device("--client-id", "dev000", "--broker", f"mqtt://127.0.0.1:{port}", "--connect-timeout", "0"))

    # Assert
    assert_one_line_failure(result, 1, f"nothing listens at 127.0.0.1:{port}", "is the broker running")


def test_wrong_password_names_the_credentials(plain):
    # Execute
    result = edgepfl(*device("--client-id", "dev000", "--broker", plain.url, "--username", "dev000",
                             "--password", "not-the-password"))

    # Assert
    assert_one_line_failure(result, 1, "refused", "user 'dev000'", "--password-file")


@pytest.mark.parametrize("source", ["environment", "file"])
def test_the_password_from_the_environment_or_a_file_is_accepted(plain, tmp_path, source):
    # Prepare: the coordinator's account, its password out of the command line
    password = plain.accounts["coordinator"].password
    secret = tmp_path / "password"
    secret.write_text(password + "\n")
    given = ["--password-file", str(secret)] if source == "file" else []
    env = {**ENV, "EDGEPFL_PASSWORD": password} if source == "environment" else ENV
    command = [sys.executable, "-m", "coordinator.cli", "coordinator", "--broker", plain.url, "--federation", FED,
               "--username", "coordinator", *given, "--registration-timeout", "1", "--out", str(tmp_path / "run")]

    # Execute: connected, it waits a second for devices that never come
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)

    # Assert: it got past the broker, and failed (no device) in one line
    assert_one_line_failure(result, 1, "registered")
    assert "refused" not in result.stderr


def test_a_tls_port_given_as_mqtt_says_use_mqtts(mutual_tls):
    # Prepare
    url = mutual_tls.url.replace("mqtts://", "mqtt://")

    # Execute
    result = edgepfl(*device("--client-id", "dev000", "--broker", url, "--credentials", str(mutual_tls.credentials)))

    # Assert
    assert_one_line_failure(result, 1, "is it a TLS port? use mqtts://")


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_device_denied_by_the_acl_stops_with_a_message_naming_it(plain, protocol):
    # Prepare: dev000 with dev001's account, which may not write under dev000's topics (MQTT 5
    # says so in PUBACK; 3.1.1 has no way to, and Mosquitto closes the connection instead)
    entry = plain.accounts["dev001"]

    # Execute
    started = time.monotonic()
    result = edgepfl(*device("--client-id", "dev000", "--broker", plain.url, "--username", entry.username,
                             "--password", entry.password, "--mqtt-protocol", protocol), timeout=120)

    # Assert
    assert_one_line_failure(result, 1, "ACL", "user 'dev001'")
    assert time.monotonic() - started < 120


def test_the_first_connection_is_retried_until_the_broker_is_up(tmp_path, monkeypatch):
    # Prepare: nothing listens on the port yet
    port = free_port()
    transport = MqttTransport(f"{FED}.late", MqttSettings(url=f"mqtt://127.0.0.1:{port}", retry_first_connect=60))
    retrying = threading.Event()
    handler = logging.Handler()
    monkeypatch.setattr(handler, "emit", lambda record: retrying.set() if "retrying" in record.getMessage() else None)
    logging.getLogger("edge_sdk.transport").addHandler(handler)
    errors: list[Exception] = []
    connecting = threading.Thread(target=lambda: _connect(transport, errors))

    # Execute: the device starts first, the broker once it has been refused
    try:
        connecting.start()
        assert retrying.wait(60)
        broker = Mosquitto(tmp_path / "mosquitto", port=port).start()
        connecting.join(timeout=90)
    finally:
        logging.getLogger("edge_sdk.transport").removeHandler(handler)

    # Assert
    try:
        assert errors == [] and transport.connected.is_set() and transport.connections == 1
    finally:
        transport.close()
        broker.stop()


def _connect(transport: MqttTransport, errors: list[Exception]) -> None:
    try:
        transport.connect()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_the_first_connection_gives_up_after_its_limit():
    # Prepare
    transport = MqttTransport(f"{FED}.never", MqttSettings(url=f"mqtt://127.0.0.1:{free_port()}",
                                                           retry_first_connect=1.5))

    # Execute
    started = time.monotonic()
    with pytest.raises(BrokerUnreachable, match="connection refused"):
        transport.connect()

    # Assert
    assert 1.5 <= time.monotonic() - started < 30


def test_an_out_folder_holding_another_run_is_a_usage_error(tmp_path):
    # Prepare: a checkpoint of a run with other settings
    out = tmp_path / "run"
    folder = RunFolder(out)
    folder.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.save(folder.checkpoint, checkpoint.Checkpoint("otherrun", 1, "0123456789abcdef", {}, {"rounds": []}))

    # Execute
    result = edgepfl("simulate", "--clients", "2", "--workers", "1", "--rounds", "1", "--quiet", "--out", str(out))

    # Assert
    assert_one_line_failure(result, 2, "holds run otherrun with other settings", "use another --out")


def test_a_simulation_whose_workers_all_die_stops_with_their_error(tmp_path):
    # Prepare: a partition every worker refuses (10 classes, 20 asked per device)
    args = ["simulate", "--partition", "shards", "--classes-per-client", "20", "--clients", "2", "--workers", "2",
            "--rounds", "1", "--registration-timeout", "600", "--quiet", "--out", str(tmp_path / "run")]

    # Execute
    started = time.monotonic()
    result = edgepfl(*args, timeout=300)

    # Assert: stopped long before the registration timeout, with the workers' error
    assert time.monotonic() - started < 300
    assert_one_line_failure(result, 1, "every device worker died", "classes_per_client must be in [1, 10]",
                            "worker0", "worker1")


STOPS = [
    # Ctrl-C at a terminal: SIGINT to the whole foreground process group
    pytest.param(lambda pid: os.killpg(pid, signal.SIGINT), 130, "interrupted", id="ctrl-c"),
    # `docker stop`, `kill PID`, Kubernetes: SIGTERM to the command alone, which must stop its own processes
    pytest.param(lambda pid: os.kill(pid, signal.SIGTERM), 143, "terminated", id="sigterm"),
]


@pytest.mark.parametrize(("send", "code", "word"), STOPS)
def test_a_stopped_simulate_prints_one_line_leaves_nothing_running_and_the_run_resumes(tmp_path, send, code, word):
    # Prepare
    out = tmp_path / "run"
    # 10 rounds: far from its end when the signal comes, even on a busy machine (with 3, under load, it exited 0)
    args = [sys.executable, "-m", "coordinator.cli", "simulate", "--clients", "2", "--workers", "2", "--rounds", "10",
            "--local-epochs", "1", "--out", str(out)]
    process = subprocess.Popen(args, stderr=subprocess.PIPE, cwd=ROOT, env=ENV, start_new_session=True,
                               preexec_fn=restore_ctrl_c)
    stderr = cast(io.BufferedReader, process.stderr)  # a pipe of bytes
    seen = b""
    while b"| 1/10" not in seen:  # the progress bar: round 1 is over (and checkpointed)
        chunk = stderr.read1(4096)
        assert chunk, f"the run ended before round 1: {seen.decode(errors='replace')}"
        seen += chunk
    children = psutil.Process(process.pid).children(recursive=True)

    # Execute
    send(process.pid)
    process.wait(timeout=120)
    _, left_running = psutil.wait_procs(children, timeout=30)
    for child in left_running:  # a failing command leaves nothing behind either (they hold its stderr open)
        child.kill()
    rest = stderr.read().decode(errors="replace")
    resumed = edgepfl(*args[3:], "--quiet", timeout=300)

    # Assert: one line, the worker processes and the embedded broker gone, the run resumable
    assert process.returncode == code
    assert "Traceback" not in rest
    lines = [line for line in rest.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert lines == [f"edgepfl simulate: {word} (rerun the same command to resume)"]
    assert len(children) >= 3 and left_running == []
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(RunFolder(out).report.read_text())["rounds_completed"] == 10
