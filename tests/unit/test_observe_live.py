"""Unit tests for the live view's state (coordinator/observe/live.py) and routes (view.py): a
`LiveState` fed synthetic events, one built from a run folder, and the page and state served
under the token rule."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from coordinator.events import (DeviceOffline, DeviceOnline, DevicesRegistered, EventBus, RegistrationOpened,
                                ReleaseServed, RoundDevices, RoundEnded, RoundStarted, RunStarted, UpdateAccepted)
from coordinator.observe.http import ObserveServer
from coordinator.observe.live import LiveState
from coordinator.observe.view import add_view_routes, page
from coordinator.releases.inventory import Inventory
from coordinator.releases.store import ReleaseStore
from coordinator.run.folder import RunFolder
from edge_sdk.channel import ChannelSnapshot


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _channel(rejections: dict[str, int]) -> ChannelSnapshot:
    return ChannelSnapshot(messages={}, bytes={}, rejections=rejections, duplicates=0, send_seconds=0.0,
                           accept_seconds=0.0, peak_pending_blobs=0, peak_pending_bytes=0)


def _record(round_: int, *, mean: float, seconds: float, epsilon: float | None = None) -> dict:
    return {"round": round_, "selected": 3, "participants": 2, "outcome": "quorum", "seconds": seconds,
            "bytes_up": 2_000_000, "bytes_down": 500_000, "late": 0, "missing": 0, "refused": 0,
            "personalized_accuracy": {"mean": mean, "std": 0.1, "min": mean - 0.2, "count": 2},
            "privacy": None if epsilon is None else {"epsilon": epsilon}}


def _played(clock: Clock) -> list:
    """Two rounds of a run of four: dev2 refused in round 1 and late in round 2, dev1 missing in
    round 2 after going offline and coming back, a weak device served the release."""
    selected = ("dev0", "dev1", "dev2")
    return [
        RunStarted("run-1", 0, 4), RegistrationOpened(4),
        *(DeviceOnline(d, "trainer", i + 1, i + 1) for i, d in enumerate(selected)),
        DeviceOnline("weak0", "lite", 4, 4), DeviceOnline("aggregator-0", "aggregator", 4, 4),
        DevicesRegistered(4, 3, 1.5),
        RoundStarted(1, selected), UpdateAccepted(1, "dev0", 100, 1.0, 0.1, 0.1),
        RoundEnded(1, _record(1, mean=0.5, seconds=10.0, epsilon=0.8), _channel({"non_finite": 1}),
                   RoundDevices(replied=("dev0", "dev1"), refused={"dev2": "non_finite"},
                                accuracy={"dev0": 0.6, "dev1": 0.4})),
        DeviceOffline("dev1", 3), DeviceOnline("dev1", "trainer", 4, 4),
        RoundStarted(2, selected),
        RoundEnded(2, _record(2, mean=0.7, seconds=20.0, epsilon=1.2), _channel({}),
                   RoundDevices(replied=("dev0",), late=("dev2",), missing=("dev1",), accuracy={"dev0": 0.75})),
        ReleaseServed("weak0", "ab" * 32, 5000),
    ]


def test_the_state_follows_the_run_its_devices_rounds_and_events():
    # Prepare
    clock = Clock()
    state = LiveState({"algorithm": "fedavg", "dataset": "digits", "model": "cnn8"}, clock=clock)
    bus = EventBus()
    state.attach(bus)

    # Execute
    for event in _played(clock):
        clock.now += 1
        bus.emit(event)
    shown = json.loads(state.to_bytes())

    # Assert: the run, round 2 of 4, two more rounds at the mean of 15 s each
    run = shown["run"]
    assert (run["algorithm"], run["dataset"], run["model"], run["run_id"]) == ("fedavg", "digits", "cnn8", "run-1")
    assert (run["completed"], run["rounds"], run["finished"]) == (2, 4, False)
    assert run["seconds_per_round"] == 15.0 and run["seconds_left"] == 30.0
    assert (run["devices"], run["online"]) == (4, 4)

    # Assert: every device but the aggregator, with what the events told of it
    devices = {d["id"]: d for d in shown["devices"]}
    assert sorted(devices) == ["dev0", "dev1", "dev2", "weak0"]
    assert devices["weak0"]["kind"] == "lite" and devices["weak0"]["selected"] == 0
    counts = {d: tuple(devices[d][k] for k in ("selected", "replied", "late", "missing", "refused"))
              for d in ("dev0", "dev1", "dev2")}
    assert counts == {"dev0": (2, 2, 0, 0, 0), "dev1": (2, 1, 0, 1, 0), "dev2": (2, 0, 1, 0, 1)}
    assert devices["dev2"]["rejections"] == {"non_finite": 1} and devices["dev0"]["rejections"] == {}
    assert (devices["dev0"]["accuracy"], devices["dev0"]["accuracy_round"]) == (0.75, 2)
    assert (devices["dev1"]["accuracy"], devices["dev1"]["accuracy_round"]) == (0.4, 1)
    assert devices["dev2"]["accuracy"] is None

    # Assert: a point per round, epsilon included, and the rejections by reason
    assert [(r["round"], r["accuracy"], r["epsilon"], r["mb_up"]) for r in shown["rounds"]] == [
        (1, 0.5, 0.8, 2.0), (2, 0.7, 1.2, 2.0)]
    assert shown["rejections"] == {"non_finite": 1}

    # Assert: the device events in order
    assert [(e["event"], e["device"]) for e in shown["events"]] == [
        ("online", "dev0"), ("online", "dev1"), ("online", "dev2"), ("online", "weak0"),
        ("refused", "dev2"), ("offline", "dev1"), ("reconnected", "dev1"), ("late", "dev2"), ("missing", "dev1"),
        ("released", "weak0")]


def test_under_dp_the_state_publishes_no_device_s_counts_or_accuracy_and_no_round_s_counts():
    # Prepare: the same run under DP
    clock = Clock()
    state = LiveState({"algorithm": "fedavg"}, clock=clock, private=True)
    bus = EventBus()
    state.attach(bus)

    # Execute
    for event in _played(clock):
        clock.now += 1
        bus.emit(event)
    shown = json.loads(state.to_bytes())

    # Assert: who is online, the released mean and the epsilon; nothing of who was sampled or answered
    assert shown["run"]["private"] and (shown["run"]["devices"], shown["run"]["online"]) == (4, 4)
    for device in shown["devices"]:
        assert all(device[k] is None for k in ("selected", "replied", "late", "missing", "refused", "accuracy"))
        assert device["rejections"] == {} and device["kept"] is None
    assert [(r["round"], r["accuracy"], r["epsilon"]) for r in shown["rounds"]] == [(1, 0.5, 0.8), (2, 0.7, 1.2)]
    assert all(r[k] is None for r in shown["rounds"]
               for k in ("selected", "participants", "late", "missing", "refused", "mb_up", "accuracy_std"))
    assert shown["rejections"] == {}
    assert [e["event"] for e in shown["events"]] == ["online"] * 4 + ["offline", "reconnected", "released"]


def test_the_event_history_is_bounded_to_the_latest():
    # Prepare
    state = LiveState({}, clock=Clock(), history=3)

    # Execute
    for index in range(5):
        state.on_event(DeviceOnline(f"dev{index}", "trainer", index + 1, index + 1))

    # Assert
    assert [e["device"] for e in state.to_json()["events"]] == ["dev2", "dev3", "dev4"]
    assert len(state.to_json()["devices"]) == 5


def test_a_figure_that_is_not_finite_is_served_as_null():
    # Prepare
    state = LiveState({})
    state.on_event(RoundEnded(1, _record(1, mean=float("nan"), seconds=1.0), _channel({})))

    # Execute
    shown = json.loads(state.to_bytes())

    # Assert
    assert shown["rounds"][0]["accuracy"] is None


def _write_run_folder(path) -> RunFolder:
    folder = RunFolder(path)
    folder.path.mkdir()
    rounds = [_record(1, mean=0.5, seconds=4.0), _record(2, mean=0.8, seconds=6.0)]
    lines = [json.dumps({"event": "round", **r}) for r in rounds] + [json.dumps({"event": "release", "round": 2}),
                                                                     '{"event": "round", "rou']  # a torn last line
    folder.metrics.write_text("\n".join(lines))
    report = {"run_id": "run-9", "algorithm": "fedrep", "dataset": "digits", "model": "cnn8", "rounds_completed": 2,
              "rounds": rounds, "rejections": {"stale": 2},
              "data": {"per_device": {"dev0": {"kind": "trainer"}, "dev1": {"kind": "trainer"},
                                      "weak0": {"kind": "lite"}}},
              "final": {"per_client": {"dev0": {"accuracy": 0.9, "kind": "trainer"},
                                       "weak0": {"accuracy": 0.7, "kind": "lite"}}},
              "event_log": [{"event": "started", "time": 1.0},
                            {"event": "registered", "device": "dev0", "round": 1, "time": 2.0},
                            {"event": "registered", "device": "dev1", "round": 1, "time": 2.5},
                            {"event": "registered", "device": "weak0", "round": 1, "time": 3.0},
                            {"event": "offline", "device": "dev1", "round": 2, "time": 4.0},
                            {"event": "released", "round": 2, "time": 5.0}]}
    folder.report.write_text(json.dumps(report))
    return folder


def test_the_state_of_a_finished_run_comes_from_its_folder(tmp_path):
    # Prepare
    folder = _write_run_folder(tmp_path / "run")

    # Execute
    shown = LiveState.from_folder(folder).to_json()

    # Assert: the run and its rounds
    run = shown["run"]
    assert (shown["source"], run["run_id"], run["algorithm"], run["completed"], run["rounds"]) == (
        "folder", "run-9", "fedrep", 2, 2)
    assert run["finished"] and run["seconds_per_round"] == 5.0 and run["seconds_left"] == 0.0
    assert [r["accuracy"] for r in shown["rounds"]] == [0.5, 0.8]
    assert shown["rejections"] == {"stale": 2}

    # Assert: every device of the report, its kind, final accuracy and last state; no participation counts
    devices = {d["id"]: d for d in shown["devices"]}
    assert {d: (v["kind"], v["accuracy"], v["online"]) for d, v in devices.items()} == {
        "dev0": ("trainer", 0.9, True), "dev1": ("trainer", None, False), "weak0": ("lite", 0.7, True)}
    assert devices["dev0"]["selected"] is None and devices["dev0"]["last_seen"] == 2.0
    assert [(e["event"], e["device"]) for e in shown["events"]] == [
        ("online", "dev0"), ("online", "dev1"), ("online", "weak0"), ("offline", "dev1"), ("released", None)]


def test_the_folder_view_of_a_private_run_publishes_no_device_s_accuracy(tmp_path):
    # Prepare: the finished run's report says it ran under DP
    folder = _write_run_folder(tmp_path / "run")
    report = json.loads(folder.report.read_text())
    folder.report.write_text(json.dumps({**report, "privacy": {"epsilon": 2.0}}))

    # Execute
    shown = LiveState.from_folder(folder).to_json()

    # Assert
    assert shown["run"]["private"] and shown["rejections"] == {}
    assert [r["accuracy"] for r in shown["rounds"]] == [0.5, 0.8]
    assert all(d["accuracy"] is None and d["selected"] is None for d in shown["devices"])


def test_the_folder_view_of_a_private_run_still_going_publishes_no_round_s_counts(tmp_path):
    # Prepare: metrics.jsonl of a private run, no report yet
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir(parents=True)
    folder.metrics.write_text("\n".join(json.dumps({"event": "round", **_record(r, mean=0.5, seconds=1.0,
                                                                                   epsilon=0.1 * r)})
                                        for r in (1, 2)) + "\n")

    # Execute
    shown = LiveState.from_folder(folder).to_json()

    # Assert
    assert shown["run"]["private"]
    assert [(r["epsilon"], r["participants"], r["selected"]) for r in shown["rounds"]] == [(0.1, None, None),
                                                                                           (0.2, None, None)]


def test_the_folder_view_shows_which_release_each_weak_device_runs(tmp_path):
    # Prepare: the run's release inventory, one device of it online only after training
    folder = _write_run_folder(tmp_path / "run")
    ReleaseStore(folder.path).add(b"body", {"feature_dim": 4}, {"run_id": "run-9", "round": 2}, None, "released")
    inventory = Inventory(folder.path)
    inventory.record("weak0", runs=1, runs_sha256="a" * 64, accuracy=0.75, evaluated=2, evaluated_accuracy=0.6,
                     kept="scored 0.6000 < 0.7500 on its own data")
    inventory.record("weak7", runs=1, runs_sha256="a" * 64, accuracy=0.8, evaluated=1, evaluated_accuracy=0.8,
                     kept=None)

    # Execute
    shown = LiveState.from_folder(folder).to_json()

    # Assert
    devices = {d["id"]: d for d in shown["devices"]}
    assert shown["run"]["release"] == 1
    assert (devices["weak0"]["release"], devices["weak0"]["accuracy"]) == (1, 0.75)
    assert "own data" in devices["weak0"]["kept"]
    assert (devices["weak7"]["kind"], devices["weak7"]["release"], devices["weak7"]["kept"]) == ("lite", 1, None)
    assert devices["dev0"]["release"] is None


def test_a_run_still_going_shows_its_rounds_without_a_report(tmp_path):
    # Prepare
    folder = _write_run_folder(tmp_path / "run")
    folder.report.unlink()

    # Execute
    shown = LiveState.from_folder(folder).to_json()

    # Assert
    assert (shown["run"]["completed"], shown["run"]["rounds"], shown["run"]["finished"]) == (2, None, False)
    assert [r["round"] for r in shown["rounds"]] == [1, 2] and shown["devices"] == []


def test_a_resumed_run_shows_the_rounds_it_played_before(tmp_path):
    # Prepare
    folder = _write_run_folder(tmp_path / "run")
    state = LiveState({}, folder=folder)

    # Execute: resumed after round 1 (the folder's round 2 is not this incarnation's yet)
    state.on_event(RunStarted("run-9", 1, 3))
    state.on_event(RoundEnded(2, _record(2, mean=0.9, seconds=1.0), _channel({})))

    # Assert
    assert [(r["round"], r["accuracy"]) for r in state.to_json()["rounds"]] == [(1, 0.5), (2, 0.9)]


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_page_and_the_state_are_served_under_the_token():
    # Prepare
    state = LiveState({"algorithm": "fedavg"})
    state.on_event(RunStarted("run-2", 0, 3))
    server = ObserveServer("127.0.0.1", 0, token="s3cret")
    add_view_routes(server, lambda: state)

    # Execute
    with server:
        without = [_get(f"{server.url}{path}")[0] for path in ("/", "/state.json")]
        status, html = _get(f"{server.url}/", "s3cret")
        by_query = _get(f"{server.url}/state.json?token=s3cret")

    # Assert
    assert without == [401, 401]
    assert status == 200 and html == page()
    assert by_query[0] == 200 and json.loads(by_query[1])["run"]["run_id"] == "run-2"


def test_the_page_carries_its_style_and_script_inline():
    # Execute
    html = page().decode()

    # Assert: no placeholder left, no second request needed (each would need the token)
    assert "/*STYLE*/" not in html and "/*SCRIPT*/" not in html
    assert "function poll()" in html and "svg.chart" in html
    assert 'src="' not in html and 'href="' not in html


def test_edgepfl_view_refuses_a_public_address_without_a_token(tmp_path, capsys):
    # Prepare
    from coordinator.cli import main

    folder = _write_run_folder(tmp_path / "run")

    # Execute
    code = main(["view", str(folder.path), "--http", "0.0.0.0:0"])

    # Assert
    assert code == 2 and "http_token" in capsys.readouterr().err


def test_edgepfl_view_refuses_a_folder_without_a_run(tmp_path, capsys):
    # Prepare
    from coordinator.cli import main

    # Execute
    code = main(["view", str(tmp_path), "--http", "127.0.0.1:0"])

    # Assert
    assert code == 2 and "no run here" in capsys.readouterr().err
