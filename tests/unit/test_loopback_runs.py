"""Whole runs over the loopback broker (tests/loopback_runs.py): what a run plays, publishes,
writes and counts, that personal parameters never travel, and that a run resumes or, once
finished, is left as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge_sdk.protocol import Kind
from loopback_runs import WAIT, drain, metrics_rounds, run_in_background


def test_fedavg_runs_two_rounds_and_personal_statistics_never_travel(federation):
    # Prepare
    from edge_sdk.models import build_model, statistics_keys

    config = federation.config()
    coordinator = federation.coordinator(config)
    spy = federation.spy(Kind.TRAIN_RES)
    devices = [federation.start_device(i, 3) for i in range(3)]

    # Execute
    report = coordinator.run()

    # Assert: the run
    assert report["rounds_completed"] == 2
    assert [r["outcome"] for r in report["rounds"]] == ["complete", "complete"]
    assert [r["participants"] for r in report["rounds"]] == [3, 3]
    assert metrics_rounds(Path(config.run.out)) == [1, 2]
    assert sorted(report["final"]["per_client"]) == devices
    assert report["rejections"] == {}
    assert federation.devices_exit(), "devices should leave on the retained 'finished' status"

    # Assert: what went up, as a bystander decoded it
    results = drain(spy)
    model = build_model(config.model_name, config.task(), seed=0)
    statistics = statistics_keys(model)
    assert statistics  # the model has BatchNorm statistics to keep home
    assert sorted((e.sender, e.round) for e in results) == sorted((d, r) for d in devices for r in (1, 2))
    for envelope in results:
        keys = {key for group in envelope.groups.values() for key in group}
        assert "head.weight" in keys and "body.0.weight" in keys
        assert not keys & statistics, f"{envelope.sender} sent personal statistics"

    # Assert: each device kept its personal state on its own disk
    for device in devices:
        assert (federation.state_dir(device) / f"personal-{device}.msgpack").is_file()



def test_the_coordinator_publishes_its_rounds_as_events_in_order(federation):
    # Prepare
    from coordinator.events import (DeviceOnline, DevicesRegistered, RegistrationOpened, RoundAggregated, RoundEnded,
                                    RoundEvaluated, RoundStarted, RunStarted, UpdateAccepted)

    config = federation.config(eval_every=1)
    coordinator = federation.coordinator(config)
    events: list = []
    coordinator.subscribe(events.append)
    ended: list = []
    coordinator.subscribe(ended.append, RoundEnded)
    devices = [federation.start_device(i, 3) for i in range(3)]

    # Execute
    report = coordinator.run()

    # Assert: each device came online while registration was open (a device that waited long for
    # WELCOME may say HELLO again), the third one making three
    registered_at = next(i for i, e in enumerate(events) if isinstance(e, DevicesRegistered))
    online = [e for e in events[:registered_at] if isinstance(e, DeviceOnline)]
    events = [e for e in events if not isinstance(e, DeviceOnline)]
    assert sorted({e.device for e in online}) == devices and max(e.online for e in online) == 3
    assert all(e.kind == "trainer" for e in online)

    # Assert: the order
    kinds = [type(e) for e in events]
    one_round = [RoundStarted, UpdateAccepted, UpdateAccepted, UpdateAccepted, RoundAggregated, RoundEvaluated,
                 RoundEnded]
    assert kinds == [RunStarted, RegistrationOpened, DevicesRegistered, *one_round, *one_round]
    assert ended == [e for e in events if isinstance(e, RoundEnded)]

    # Assert: the content, against the report and the channel's own counts
    assert (events[0].run_id, events[0].after_round, events[0].rounds) == (report["run_id"], 0, 2)
    assert events[1].expected == 3 and (events[2].devices, events[2].trainers) == (3, 3)
    for round_, record in zip((1, 2), report["rounds"], strict=True):
        started, *updates, aggregated, evaluated, end = events[3 + 7 * (round_ - 1): 3 + 7 * round_]
        assert started.round == aggregated.round == evaluated.round == end.round == round_
        assert sorted(started.selected) == devices
        assert sorted(u.device for u in updates) == devices and all(u.round == round_ for u in updates)
        assert [u.seconds for u in updates] == sorted(u.seconds for u in updates)
        assert all(u.validation_seconds >= 0 and u.accumulate_seconds >= 0 for u in updates)
        assert sum(u.bytes for u in updates) == end.channel.bytes["received"]["train_res"]
        received = end.channel.messages["received"]  # a device that waited long for WELCOME may say HELLO again
        assert (received["train_res"], received["eval_res"]) == (3, 3)
        assert aggregated.participants == 3 and evaluated.devices == 3
        assert evaluated.accuracy == record["personalized_accuracy"]["mean"]
        assert end.record == record and end.channel.rejections == record["rejections"] == {}



def test_a_run_leaves_its_files_where_its_run_folder_names_them(federation):
    # Prepare
    from saved_runs import checkpoint_at

    config = federation.config(rounds=1)
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert
    folder = federation.folder
    assert folder.path == Path(config.run.out)
    assert json.loads(folder.report.read_text())["run_id"] == report["run_id"]
    assert checkpoint_at(folder.checkpoint).round == 1
    assert [json.loads(line)["round"] for line in folder.metrics.read_text().splitlines()] == [1]
    assert sorted(p.name for p in folder.state_dir.iterdir()) == ["dev000", "dev001", "dev002"]



def test_a_first_registration_is_one_event(federation):
    # Prepare: the coordinator's STATUS is retained before any device connects
    coordinator = federation.coordinator(federation.config(rounds=1))
    runner, result, listening = run_in_background(coordinator)
    assert listening.wait(WAIT)

    # Execute
    for i in range(3):
        federation.start_device(i, 3)
    runner.join(60)

    # Assert
    assert not runner.is_alive(), "the run did not finish"
    assert result["events"]["registered"] == 3
    assert result["events"].get("rejoined", 0) == 0



def test_delivered_bytes_count_a_broadcast_once_per_online_device(federation):
    # Prepare
    coordinator = federation.coordinator(federation.config(rounds=1))
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert
    comm = report["communication"]
    published, delivered = comm["by_kind"]["down"], comm["by_kind"]["down_delivered"]
    assert delivered["train"] == 3 * published["train"] and delivered["evaluate"] == 3 * published["evaluate"]
    assert delivered["welcome"] == published["welcome"]  # a device's own topic: one recipient
    assert comm["bytes_down_published"] == comm["bytes_down"] < comm["bytes_down_delivered"]
    assert report["rounds"][0]["bytes_down_delivered"] > report["rounds"][0]["bytes_down"]



def test_resume_continues_the_same_run(federation):
    # Prepare: a finished 2-round run
    first = federation.coordinator(federation.config(rounds=2))
    for i in range(3):
        federation.start_device(i, 3)
    report1 = first.run()
    first.channel.transport.close()
    assert report1["rounds_completed"] == 2 and federation.devices_exit()
    federation.threads.clear()

    # Execute: a new coordinator (and restarted devices) on the same out, extended to 3 rounds
    from coordinator.events import RunStarted

    second = federation.coordinator(federation.config(rounds=3))
    started: list = []
    second.subscribe(started.append, RunStarted)
    for i in range(3):
        federation.start_device(i, 3)
    report2 = second.run()

    # Assert
    played = sum(r["bytes_up"] + r["bytes_down"] for r in report1["rounds"])
    assert started == [RunStarted(first.run_id, 2, 3, played)]
    assert report2["wall_seconds"] > report1["wall_seconds"]  # the time of both incarnations
    assert second.run_id == first.run_id
    assert report2["run_id"] == report1["run_id"]
    assert report2["rounds_completed"] == 3
    assert [r["round"] for r in report2["rounds"]] == [1, 2, 3]
    assert report2["rounds"][2]["outcome"] == "complete"
    assert metrics_rounds(Path(second.config.run.out)) == [1, 2, 3]
    assert federation.devices_exit()



def test_a_rerun_of_a_finished_run_changes_nothing(federation):
    # Prepare: a finished 1-round run
    from coordinator.server import finished_report

    config = federation.config(rounds=1)
    first = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)
    report1 = first.run()
    first.channel.transport.close()
    assert federation.devices_exit()
    written = federation.folder.report.read_bytes()
    metrics = federation.folder.metrics.read_bytes()

    # Execute: the same run again, no device needed
    again = finished_report(config)
    report2 = federation.coordinator(config).run()

    # Assert
    assert again == report2 == json.loads(written)
    assert report2["wall_seconds"] == report1["wall_seconds"]
    assert report2["communication"] == report1["communication"]
    assert federation.folder.report.read_bytes() == written and federation.folder.metrics.read_bytes() == metrics

