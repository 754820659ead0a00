"""Runs under secure aggregation over the loopback broker (tests/loopback_runs.py): the global
model is the plain run's within the quantization error, nobody upstream sees an update in the
clear, a device lost after sharing its keys is unmasked away, and what cannot run is refused.
A release pools the trainers' BatchNorm statistics and the weak devices' prototypes as secure
sums too."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from coordinator.run.folder import RunFolder
from edge_sdk.config import ConfigError
from edge_sdk.data import load_client_data
from edge_sdk.privacy.disclosure import COUNTS, EXAMPLES_BUCKET
from edge_sdk.protocol import PROTOTYPES, STATISTICS, Kind
from edge_sdk.secagg import stages
from loopback_runs import BlockingLock, drain, listener
from saved_runs import checkpoint_at
from secure_fleets import DEVICES, fleet_keys, start_with_the_last_lost


def start_sharded_fleet(federation, devices: int, shards: int, wrap=None) -> None:
    """The shards' aggregators, then `devices` enrolled devices (their data `wrap(index, data)`)."""
    for shard in range(shards):
        federation.start_aggregator(shard, shards)
    for i, keys in enumerate(fleet_keys(devices)):
        federation.start_device(i, devices, secagg_keys=keys, wrap=wrap and (lambda data, i=i: wrap(i, data)))


SMALL_SHARD = (2, 3, 5)
"""The devices of shard 0 of two (sharding.shard_of)."""


def fewer_in_shard_0(index: int, data):
    """A quarter of the training examples for shard 0's devices: a smaller power of two than shard
    1's (64 against 256 on digits), so that one scale for the whole round matters."""
    if index not in SMALL_SHARD:
        return data
    keep = data.num_train // 4
    return dataclasses.replace(data, train_x=data.train_x[:keep], train_y=data.train_y[:keep])


def secure_config(federation, **changes):
    return federation.config(**{"clients": DEVICES, "secure_aggregation": True, "aggregation_dtype": "float64",
                                **changes})


def final_state(federation) -> dict:
    return checkpoint_at(federation.folder.checkpoint).state


def test_a_secure_run_reaches_the_plain_run_s_model_and_uploads_only_masked_vectors(federation, tmp_path):
    # Prepare: the plain run first, in a folder of its own
    plain_config = federation.config(clients=DEVICES, aggregation_dtype="float64", out=str(tmp_path / "plain"))
    coordinator = federation.coordinator(plain_config)
    for i in range(DEVICES):
        federation.start_device(i, DEVICES)
    coordinator.run()
    federation.devices_exit()
    plain = checkpoint_at(tmp_path / "plain" / "checkpoint.msgpack").state
    federation.threads.clear()

    coordinator = federation.coordinator(secure_config(federation))
    up = federation.spy(Kind.TRAIN_RES)
    hellos, evaluations = federation.spy(Kind.HELLO), federation.spy(Kind.EVAL_RES)
    for i, keys in enumerate(fleet_keys(DEVICES)):
        federation.start_device(i, DEVICES, secagg_keys=keys)

    # Execute
    report = coordinator.run()

    # Assert: every round aggregated all four; each update is one int32 vector, nothing else
    assert [r["participants"] for r in report["rounds"]] == [DEVICES, DEVICES]
    assert all(r["secagg"]["unmasked"] == DEVICES and not r["secagg"]["dropped"] for r in report["rounds"])
    (figures,) = report["secagg"]["by_devices"]  # 4 devices: the complete graph, k 3, t 2
    assert (figures["devices"], figures["degree"], figures["threshold"], figures["rounds"]) == (DEVICES, 3, 2, [1, 2])
    assert (figures["colluders"], figures["lost"]) == (0, 1)
    for update in drain(up):
        assert set(update.groups) == {stages.SECURE} and set(update.groups[stages.SECURE]) == {stages.MASKED}
        assert update.groups[stages.SECURE][stages.MASKED].dtype == np.int32
    secure = final_state(federation)
    for key, value in plain["shared"].items():
        assert np.allclose(secure["shared"][key], value, atol=1e-5), key
    # no HELLO said an exact count or the labels, only the power of two above the examples (the
    # weights' scale: the devices' counts differ, and the mean is still the plain run's)
    counts = [load_client_data("digits", num_clients=DEVICES, index=i, seed=0).num_train for i in range(DEVICES)]
    assert len(set(counts)) > 1
    said = {hello.sender: hello for hello in drain(hellos)}
    assert sorted(said) == [f"dev{i:03d}" for i in range(DEVICES)]
    for i, count in enumerate(counts):
        hello = said[f"dev{i:03d}"]
        assert hello.metrics == {EXAMPLES_BUCKET: math.ceil(math.log2(count))} and "label_counts" not in hello.config
    assert report["data"]["examples"] == 0 and report["data"]["label_counts"] is None
    assert report["data"]["examples_at_most"] == sum(2 ** math.ceil(math.log2(c)) for c in counts)
    assert [d["examples_at_most"] for d in report["data"]["per_device"].values()] == [
        2 ** math.ceil(math.log2(c)) for c in counts]
    # the evaluation replies carry the accuracies (the run's output) and no count
    replies = drain(evaluations)
    assert replies and all("accuracy" in e.metrics and not set(e.metrics) & set(COUNTS) for e in replies)


def test_a_device_lost_after_sharing_its_keys_is_unmasked_away(federation):
    # Prepare: dev003 is parked inside its first training, then announced offline (its Last Will)
    parked = BlockingLock()
    coordinator = federation.coordinator(secure_config(federation, rounds=1, min_clients=3))
    unmask = listener(federation.broker, "spy-unmask", f"{federation.topics.prefix}/down/all/secagg",
                      federation.topics)
    lost = start_with_the_last_lost(federation, parked)

    # Execute
    report = coordinator.run()
    parked.release.set()

    # Assert: the round aggregated the three survivors, the lost device's masks removed
    record = report["rounds"][0]
    assert record["participants"] == DEVICES - 1
    assert record["secagg"]["dropped"] == [lost] and record["secagg"]["failed"] is None
    assert record["secagg"]["confirmed"] == DEVICES - 1 and record["secagg"]["refused"] == []
    stages_sent = [envelope.config[stages.STAGE] for envelope in drain(unmask)]
    assert stages_sent == [stages.ADVERTISE, stages.SHARE, stages.CONFIRM, stages.UNMASK]


def test_a_sharded_secure_run_unmasks_each_shard_s_sum_and_reaches_the_plain_run_s_model(federation, tmp_path):
    # Prepare: the plain run first, then six devices in two shards of three (dev002, 3, 5 in shard 0,
    # with fewer examples: the round's one scale weighs them against shard 1's)
    devices, shards = 6, 2
    plain_config = federation.config(clients=devices, rounds=1, aggregation_dtype="float64",
                                     out=str(tmp_path / "plain"))
    coordinator = federation.coordinator(plain_config)
    for i in range(devices):
        federation.start_device(i, devices, wrap=lambda data, i=i: fewer_in_shard_0(i, data))
    coordinator.run()
    federation.devices_exit()
    plain = checkpoint_at(tmp_path / "plain" / "checkpoint.msgpack").state
    federation.threads.clear()

    coordinator = federation.coordinator(secure_config(federation, clients=devices, rounds=1, shards=shards))
    partials = federation.spy(Kind.PARTIAL)
    uploads = listener(federation.broker, "spy-shards", f"{federation.topics.prefix}/+/+/train_res",
                       federation.topics)
    start_sharded_fleet(federation, devices, shards, wrap=fewer_in_shard_0)

    # Execute
    report = coordinator.run()

    # Assert: each shard's aggregator sent one masked sum over its three devices; the coordinator
    # unmasked both; every upload it could have read is a masked vector
    record = report["rounds"][0]
    assert record["participants"] == devices and record["secagg"]["unmasked"] == devices
    assert record["secagg"]["failed"] is None and record["secagg"]["failed_groups"] == []
    assert record["secagg"]["groups"] == [3, 3]
    assert [(f["devices"], f["rounds"]) for f in report["secagg"]["by_devices"]] == [(3, [1])]
    sent = {p.sender: p for p in drain(partials)}
    assert sorted(sent) == ["aggregator-0", "aggregator-1"]
    assert sorted(sent["aggregator-0"].config["folded"]) == ["dev002", "dev003", "dev005"]
    for partial in sent.values():
        assert set(partial.groups) == {stages.SECURE} and set(partial.groups[stages.SECURE]) == {stages.MASKED}
    masked = drain(uploads)
    assert len(masked) == devices
    assert all(set(u.groups) == {stages.SECURE} for u in masked)
    secure = final_state(federation)
    for key, value in plain["shared"].items():
        assert np.allclose(secure["shared"][key], value, atol=1e-5), key


def test_a_shard_too_small_to_hide_its_devices_sits_the_round_out_and_the_other_aggregates(federation):
    # Prepare: five devices in two shards: dev002 and dev003 alone in shard 0
    devices, shards = 5, 2
    coordinator = federation.coordinator(secure_config(federation, clients=devices, rounds=1, shards=shards,
                                                       min_clients=3))
    trains = listener(federation.broker, "spy-train", f"{federation.topics.prefix}/down/all/train", federation.topics)
    start_sharded_fleet(federation, devices, shards)

    # Execute
    report = coordinator.run()

    # Assert: shard 0's devices were never asked to train; shard 1's three were aggregated
    record = report["rounds"][0]
    assert record["participants"] == 3 and record["secagg"]["failed"] is None
    assert [why.split(":")[0] for why in record["secagg"]["failed_groups"]] == ["shard 0"]
    assert "needs at least 3" in record["secagg"]["failed_groups"][0]
    (train,) = [t for t in drain(trains) if t.round == 1]
    assert sorted(train.config["selected"]) == ["dev000", "dev001", "dev004"]


def test_a_device_without_keys_is_refused_by_name(federation):
    coordinator = federation.coordinator(secure_config(federation, clients=3, rounds=1, registration_timeout=3.0))
    welcomes = listener(federation.broker, "spy-welcome", f"{federation.topics.prefix}/down/+/welcome",
                        federation.topics)
    keys = fleet_keys(3)
    federation.start_device(0, 3, secagg_keys=keys[0])
    federation.start_device(1, 3, secagg_keys=keys[1])
    federation.start_device(2, 3)
    report = coordinator.run()
    refusals = [e.config["refused"] for e in drain(welcomes) if "refused" in e.config]
    assert len(refusals) == 1 and "requires secure aggregation" in refusals[0]
    assert report["rounds"][0]["outcome"] == "aborted", "two devices: a sum would tell each the other's update"
    assert "needs at least 3" in report["rounds"][0]["secagg"]["failed"]


def test_a_device_of_an_older_secure_aggregation_is_refused_naming_the_versions(federation, monkeypatch):
    # Prepare: devices that speak the version before this one (no survivor signatures)
    from coordinator.fleet.registration import RegistrationTimeout
    from edge_sdk.secagg.session import SecureSession

    monkeypatch.setattr(SecureSession, "secure_capability",
                        lambda self: {stages.CAPABILITY: stages.VERSION - 1} if self.secure is not None else {})
    coordinator = federation.coordinator(secure_config(federation, clients=3, rounds=1, registration_timeout=3.0))
    welcomes = listener(federation.broker, "spy-welcome", f"{federation.topics.prefix}/down/+/welcome",
                        federation.topics)
    for i, keys in enumerate(fleet_keys(3)):
        federation.start_device(i, 3, secagg_keys=keys)

    # Execute
    with pytest.raises(RegistrationTimeout):
        coordinator.run()

    # Assert: each refused at registration, told which version the run needs and which it speaks
    refusals = [e.config["refused"] for e in drain(welcomes) if "refused" in e.config]
    assert len(refusals) == 3
    assert all(f"(version {stages.VERSION})" in r and f"it speaks version {stages.VERSION - 1}: update its edgepfl"
               in r for r in refusals)


@pytest.mark.parametrize(("change", "key"), [
    ({"aggregation": "median"}, "aggregation"),
    ({"max_update_norm": 5.0}, "max_update_norm"),
    ({"upload_codec": "int8"}, "upload_codec"),
    ({"upload_codec": "topk"}, "upload_codec"),
    ({"upload_codec": "q4"}, "upload_codec"),
    ({"algorithm": "dc_pfl"}, "algorithm"),
    ({"dp": "central", "dp_noise": 1.0}, "dp"),
])
def test_what_needs_single_updates_is_refused_by_name(federation, change, key):
    with pytest.raises(ConfigError, match=f"secure_aggregation: {key}"):
        federation.coordinator(secure_config(federation, **change))


def release_run(federation, out, *, secure: bool, weak: int = 3, lose_a_weak_device: bool = False):
    """FedAvg with --release, four trainers and `weak` weak devices, one round; under secure
    aggregation every device enrolled; the last weak device lost after it shared its keys, when
    asked. Returns (report, the EVAL_RES spy, the final EVALUATE)."""
    first_lite = 4
    devices = first_lite + weak
    changes = {"clients": devices, "rounds": 1, "release": True, "lite_fraction": weak / devices,
               "aggregation_dtype": "float64", "out": str(out)}
    coordinator = federation.coordinator(federation.config(**changes, secure_aggregation=secure))
    up = federation.spy(Kind.EVAL_RES)
    down = listener(federation.broker, f"spy-evaluate-{out.name}", f"{federation.topics.prefix}/down/all/evaluate",
                    federation.topics)
    keys = fleet_keys(devices) if secure else [None] * devices
    for i in range(first_lite):
        federation.start_device(i, devices, secagg_keys=keys[i])
    lites = [federation.start_lite(i, devices, secagg_keys=keys[i]) for i in range(first_lite, devices)]
    if lose_a_weak_device:  # it answers the key stages, then is lost instead of masking its prototypes
        lost = lites[-1].client_id
        lites[-1]._send_pool_share = lambda *args: federation.announce_offline(lost)
    report = coordinator.run()
    federation.devices_exit()
    federation.threads.clear()
    final = [e for e in drain(down) if e.config.get("phase") == "final"]
    return report, drain(up), final[0]


def secure_pools(out) -> dict[str, dict]:
    lines = [json.loads(line) for line in RunFolder(out).metrics.read_text().splitlines()]
    return {line["pool"]: line for line in lines if line.get("event") == "secure_pool"}


def test_a_secure_release_pools_statistics_and_prototypes_as_sums_only(federation, tmp_path):
    # Prepare: the plain run's pooled statistics and prototypes as the reference
    _, _, plain_final = release_run(federation, tmp_path / "plain", secure=False)
    plain_statistics = np.load(RunFolder(tmp_path / "plain").body_statistics)

    # Execute
    report, uploads, final = release_run(federation, tmp_path / "secure", secure=True)

    # Assert: no EVAL_RES carried statistics or prototypes in the clear; each pool was one secure
    # sum over all its devices; what it pooled is the plain run's within the rounding (the model
    # itself differs from the plain one by the training round's quantization)
    assert uploads and all(STATISTICS not in e.groups and PROTOTYPES not in e.groups for e in uploads)
    assert all(not set(e.metrics) & set(COUNTS) for e in uploads), "a count would give a device's weight away"
    masked = [e for e in uploads if stages.SECURE in e.groups]
    assert sorted(e.sender for e in masked) == [f"dev{i:03d}" for i in range(7)]
    pools = secure_pools(tmp_path / "secure")
    assert pools["statistics"]["unmasked"] == 4 and pools["statistics"]["failed"] is None
    assert pools["prototypes"]["unmasked"] == 3 and pools["prototypes"]["failed"] is None
    statistics = np.load(RunFolder(tmp_path / "secure").body_statistics)
    for key in plain_statistics.files:
        if key.endswith("num_batches_tracked"):  # unused in inference; not in the secure sum
            assert statistics[key] == 0
        else:
            assert np.allclose(statistics[key], plain_statistics[key], atol=1e-3, rtol=1e-3), key
    assert np.array_equal(final.groups[PROTOTYPES]["counts"], plain_final.groups[PROTOTYPES]["counts"])
    assert np.allclose(final.groups[PROTOTYPES]["means"], plain_final.groups[PROTOTYPES]["means"], atol=1e-2)
    assert all(report["final"]["per_client"][f"dev{i:03d}"]["accuracy"] > 0.5 for i in range(4, 7))


def test_a_weak_device_lost_before_masking_its_prototypes_is_unmasked_away(federation, tmp_path):
    # Execute: five weak devices (degree 4, threshold 3), dev008 lost after sharing its keys
    _, _, final = release_run(federation, tmp_path / "secure", secure=True, weak=5, lose_a_weak_device=True)

    # Assert: the four survivors' prototypes pooled, exactly their class counts
    pool = secure_pools(tmp_path / "secure")["prototypes"]
    assert pool["dropped"] == ["dev008"] and pool["unmasked"] == 4 and pool["failed"] is None
    counts = sum(load_client_data("digits", num_clients=9, index=i, seed=0).class_counts() for i in range(4, 8))
    assert np.array_equal(final.groups[PROTOTYPES]["counts"], counts)


def test_a_prototype_pool_below_the_threshold_fails_cleanly_and_the_run_ends(federation, tmp_path):
    # Execute: three weak devices (degree 2, threshold 2), one lost after sharing its keys
    report, uploads, final = release_run(federation, tmp_path / "secure", secure=True, lose_a_weak_device=True)

    # Assert: the pool failed and says why; nothing of a device's prototypes went out or came
    # back; the weak devices were still evaluated on their own class means
    pool = secure_pools(tmp_path / "secure")["prototypes"]
    assert pool["unmasked"] == 0 and "too few shares to unmask" in pool["failed"]
    assert PROTOTYPES not in final.groups
    assert all(PROTOTYPES not in e.groups for e in uploads)
    assert all(report["final"]["per_client"][f"dev{i:03d}"]["accuracy"] > 0.5 for i in (4, 5))


def test_a_survivor_set_that_leaves_a_survivor_out_is_refused_and_counted(federation, monkeypatch):
    # Prepare: a coordinator that shows the confirm stage every survivor but the first
    from coordinator.rounds.secagg import SecureRound

    honest = SecureRound.config

    def lying(self, stage):
        config = honest(self, stage)
        if stage == stages.CONFIRM:
            config[stages.SURVIVORS] = config[stages.SURVIVORS][1:]
        return config

    monkeypatch.setattr(SecureRound, "config", lying)
    coordinator = federation.coordinator(secure_config(federation, rounds=1, min_clients=3))
    for i, keys in enumerate(fleet_keys(DEVICES)):
        federation.start_device(i, DEVICES, secagg_keys=keys)

    # Execute
    report = coordinator.run()

    # Assert: the left-out device refused to sign and said why; the others signed a set without it, which
    # their unmask stage contradicts (its vector is in the sum): they refuse too, and nothing is aggregated
    record = report["rounds"][0]
    assert record["outcome"] == "aborted" and record["secagg"]["confirmed"] == DEVICES - 1
    refused = record["secagg"]["refused"]
    assert refused[0].startswith("dev000 (confirm): the survivor set leaves out 'dev000'")
    assert len(refused) == DEVICES and all("(unmask)" in why for why in refused[1:])
    assert report["rejections"] == {"secagg_inconsistent": DEVICES}
