"""`edgepfl workers` hosts a share of a simulation's devices beside `edgepfl simulate`, over a real
Mosquitto, as it would on another host: the split run equals the one-host run bit for bit
(float64 aggregation), and a wrong command is refused in one line naming what is wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from ctrl_c import restore_ctrl_c
from coordinator.run.folder import RunFolder
from saved_runs import checkpoint_at

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# FediOS hands out projection blocks in order of registration: the split run registers in any order
RUN = ["--algorithm", "fedios", "--dataset", "digits", "--partition", "domains", "--clients", "4", "--rounds", "2",
       "--seed", "0", "--aggregation-dtype", "float64", "--workers", "1"]


def edgepfl(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.cli", *args]


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV,
                            preexec_fn=restore_ctrl_c)


def outcome(out: Path) -> tuple[dict, dict]:
    """(per-device final accuracies, checkpointed global state) of the run in `out`."""
    report = json.loads(RunFolder(out).report.read_text())
    per_client = {cid: {k: v for k, v in m.items() if k in ("accuracy", "global_accuracy")}
                  for cid, m in report["final"]["per_client"].items()}
    return per_client, checkpoint_at(out / "checkpoint.msgpack").state


def assert_one_line_failure(stderr: str, command: str, *fragments: str) -> None:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"edgepfl {command}: "), stderr
    for fragment in fragments:
        assert fragment in last, last


def test_two_devices_on_another_host_give_the_run_of_one_host(tmp_path, mosquitto) -> None:
    # Prepare: the one-host run
    broker = ["--broker", mosquitto.url]
    alone = run(edgepfl("simulate", *RUN, *broker, "--federation", "alone", "--out", str(tmp_path / "alone"),
                        "--quiet"))
    assert alone.returncode == 0, alone.stderr

    # Execute: the workers wait for the coordinator, which hosts devices 0-1 and waits for 2-3
    workers = start(edgepfl("workers", *RUN, *broker, "--federation", "split", "--devices", "2-3",
                            "--start-timeout", "120", "--out", str(tmp_path / "workers")))
    simulate = run(edgepfl("simulate", *RUN, *broker, "--federation", "split", "--local-devices", "0-1",
                           "--out", str(tmp_path / "split"), "--quiet"))
    stdout, stderr = workers.communicate(timeout=120)

    # Assert
    assert simulate.returncode == 0, simulate.stderr
    assert workers.returncode == 0, stderr
    assert "2 devices joined in 1 worker processes: RSS" in stdout and "MiB per device" in stdout
    alone_metrics, alone_state = outcome(tmp_path / "alone")
    split_metrics, split_state = outcome(tmp_path / "split")
    assert sorted(split_metrics) == ["dev000", "dev001", "dev002", "dev003"]
    assert split_metrics == alone_metrics
    assert set(split_state) == set(alone_state)
    for group, arrays in alone_state.items():
        assert set(split_state[group]) == set(arrays), group
        for name, value in arrays.items():
            assert np.array_equal(split_state[group][name], value), f"{group}/{name} differs from the one-host run"
    hosted = RunFolder(tmp_path / "workers")  # the personal state of the devices hosted there, only theirs
    assert hosted.device_state("dev002").exists() and not hosted.device_state("dev000").exists()


def stop(simulate: subprocess.Popen) -> None:
    """Cleanup: Ctrl-C the coordinator (started by `start`, so Ctrl-C reaches it: tests/ctrl_c.py)."""
    simulate.send_signal(signal.SIGINT)
    simulate.communicate(timeout=60)


def test_workers_with_other_settings_than_the_coordinator_are_refused_naming_them(tmp_path, mosquitto) -> None:
    # Prepare: a coordinator registering devices, none of them on its own host
    broker = ["--broker", mosquitto.url, "--federation", "other"]
    simulate = start(edgepfl("simulate", *RUN, *broker, "--local-devices", "none", "--out", str(tmp_path / "run"),
                             "--quiet"))
    try:
        # Execute: the same run but for two settings
        workers = run(edgepfl("workers", *RUN, *broker, "--devices", "2-3", "--lr", "0.1", "--partition", "iid",
                              "--start-timeout", "120", "--out", str(tmp_path / "workers")), timeout=180)
    finally:
        stop(simulate)

    # Assert
    assert workers.returncode == 2, workers.stderr
    assert_one_line_failure(workers.stderr, "workers", "settings differ from the run the coordinator announces",
                            "lr: 0.1 here, 0.05 at the coordinator",
                            "partition: 'iid' here, 'domains' at the coordinator")
    assert "alpha" not in workers.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "workers").exists()  # no device started


@pytest.mark.parametrize("devices, says", [
    ("2-9", "--devices '2-9': device 9 does not exist; the run has 4 devices"),
    ("3-2", "--devices '3-2': range 3-2 runs backwards"),
    ("1,x", "--devices '1,x': 'x' is not a device index or range"),
    ("0-2,2", "--devices '0-2,2': devices 2 are named twice"),
])
def test_a_bad_devices_range_is_refused_naming_the_flag(devices, says) -> None:
    result = run(edgepfl("workers", *RUN, "--broker", "mqtt://192.0.2.1:1883", "--devices", devices), timeout=60)

    assert result.returncode == 2, result.stderr
    assert_one_line_failure(result.stderr, "workers", says)


def test_workers_for_a_federation_that_never_starts_time_out_clearly(mosquitto) -> None:
    result = run(edgepfl("workers", *RUN, "--broker", mosquitto.url, "--federation", "never", "--devices", "0-1",
                         "--start-timeout", "2"), timeout=120)

    assert result.returncode == 1, result.stderr
    assert_one_line_failure(result.stderr, "workers", "no coordinator registered devices on federation never",
                            "within 2 s (no STATUS at all)", "start `edgepfl simulate`")


def test_ctrl_c_stops_the_workers_and_their_processes(tmp_path, mosquitto) -> None:
    # Prepare: workers whose devices joined a coordinator that hosts none, in a run of 20 rounds (far
    # from its end when Ctrl-C comes, even on a busy machine)
    broker = ["--broker", mosquitto.url, "--federation", "interrupted"]
    rounds = RUN.index("--rounds") + 1
    run = [*RUN[:rounds], "20", *RUN[rounds + 1:]]
    simulate = start(edgepfl("simulate", *run, *broker, "--local-devices", "none", "--out", str(tmp_path / "run"),
                             "--quiet"))
    workers = start(edgepfl("workers", *run, *broker, "--devices", "0-3", "--start-timeout", "120",
                            "--out", str(tmp_path / "workers")))
    assert workers.stdout is not None
    try:
        joined = workers.stdout.readline()  # the footprint line, once the devices joined
        children = psutil.Process(workers.pid).children(recursive=True)

        # Execute
        workers.send_signal(signal.SIGINT)
        _, stderr = workers.communicate(timeout=60)
    finally:
        simulate.send_signal(signal.SIGINT)
        simulate.communicate(timeout=60)

    # Assert
    assert "4 devices joined in 1 worker processes" in joined
    assert workers.returncode == 130, stderr
    assert_one_line_failure(stderr, "workers", "interrupted")
    assert children and psutil.wait_procs(children, timeout=30)[1] == []  # nothing left running


def test_a_worker_process_killed_mid_run_fails_the_command_naming_it(tmp_path, mosquitto) -> None:
    # Prepare: two worker processes of two devices each, joined
    broker = ["--broker", mosquitto.url, "--federation", "killed"]
    flags = [*RUN[:-2], "--workers", "2", "--round-timeout", "60"]
    simulate = start(edgepfl("simulate", *flags, *broker, "--local-devices", "none", "--out", str(tmp_path / "run"),
                             "--quiet"))
    workers = start(edgepfl("workers", *flags, *broker, "--devices", "0-3", "--start-timeout", "120",
                            "--out", str(tmp_path / "workers")))
    assert workers.stdout is not None
    try:
        joined = workers.stdout.readline()
        worker_processes = [p for p in psutil.Process(workers.pid).children()
                            if any("spawn_main" in part for part in p.cmdline())]

        # Execute: the kernel's OOM killer, say, ends one of them
        worker_processes[0].kill()
        _, stderr = workers.communicate(timeout=240)
        simulate_out, simulate_err = simulate.communicate(timeout=240)
    finally:
        for process in (workers, simulate):
            if process.poll() is None:
                process.kill()

    # Assert: the run finishes with the other two devices; the command names the dead worker
    assert "4 devices joined in 2 worker processes" in joined and len(worker_processes) == 2
    assert simulate.returncode == 0, simulate_err
    assert workers.returncode == 1, stderr
    assert_one_line_failure(stderr, "workers", "devices failed: signal SIGKILL (worker")
    assert "died with signal SIGKILL (SIGKILL: most often the OOM killer" in stderr
