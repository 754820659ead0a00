"""The coordinator's SecureRound and the devices' SecureUploads speaking the SECAGG stages to each other
in memory (their configs as they travel): a round that sums, a device that refuses a survivor set it
cannot sign and says why, and an advertise stage that names a graph seed."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.rounds.secagg import DeviceRefusal, SecureRound
from edge_sdk.params import ArraySpec
from edge_sdk.privacy.secagg_settings import SecAggSettings
from edge_sdk.protocol import Envelope, Kind, ProtocolError, Reason
from edge_sdk.secagg import IdentityKey, Roster, stages
from edge_sdk.secagg.device import SecAggKeys, SecureUploads
from edge_sdk.secagg.errors import Inconsistent

DEVICES = [f"dev{i}" for i in range(6)]
SPEC: dict[str, ArraySpec] = {"shared": {"w": ((3,), "float32")}}


def fleet() -> tuple[SecureRound, dict[str, SecureUploads]]:
    identities = {device: IdentityKey.generate() for device in DEVICES}
    roster = Roster({device: key.public_hex() for device, key in identities.items()})
    uploads = {device: SecureUploads(device, SecAggKeys(identities[device], roster), examples=10)
               for device in DEVICES}
    secure = SecureRound(SecAggSettings(secure_aggregation=True), "run", 1, DEVICES, SPEC,
                         {device: 10 for device in DEVICES})
    return secure, uploads


def request(stage: str, config: dict) -> Envelope:
    return Envelope(Kind.SECAGG, "coordinator", run_id="run", round=1, config={stages.STAGE: stage, **config})


def stage(secure: SecureRound, uploads: dict[str, SecureUploads], name: str, devices: list[str]) -> None:
    """Broadcast stage `name` to `devices` and hand each answer to the round, as the coordinator does."""
    sent = request(name, secure.config(name))
    for device in devices:
        reply = uploads[device].on_stage(sent)
        assert reply is not None
        secure.on_reply(name, device, {stages.STAGE: name, **reply})


def masked(secure: SecureRound, uploads: dict[str, SecureUploads], devices: list[str]) -> None:
    """Key sharing, the `shares` deliveries and each device's masked upload of [1, 2, 3] x its index."""
    stage(secure, uploads, stages.ADVERTISE, DEVICES)
    stage(secure, uploads, stages.SHARE, DEVICES)
    for device, delivery in secure.deliveries().items():
        uploads[device].on_stage(request(stages.SHARES, delivery))
    train = Envelope(Kind.TRAIN, "coordinator", run_id="run", round=1, groups={"shared": {"w": np.zeros(3, "float32")}})
    for device in devices:
        change = np.array([1, 2, 3], dtype="float32") * DEVICES.index(device) / 10
        uploads[device].vector(train, {"shared": {"w": change}})
        reply = uploads[device].ready()
        assert reply is not None
        secure.on_masked(device, reply.groups)


def test_the_stages_sum_the_survivors_and_the_confirm_stage_comes_before_unmask():
    # Prepare: dev5 drops after sharing keys
    secure, uploads = fleet()
    survivors = DEVICES[:5]
    masked(secure, uploads, survivors)

    # Execute
    stage(secure, uploads, stages.CONFIRM, survivors)
    stage(secure, uploads, stages.UNMASK, survivors)

    # Assert: the weighted sum of the survivors' changes, each weight 1
    sums = secure.partial()["shared"]
    np.testing.assert_allclose(sums.sums["w"], np.array([1, 2, 3]) * sum(range(5)) / 10, atol=1e-5)
    assert sums.total_weight == pytest.approx(5) and sums.count == 5
    assert (secure.record.confirmed, secure.record.unmasked) == (5, 5)


def test_a_device_shown_a_survivor_set_without_itself_refuses_and_the_round_counts_why():
    # Prepare
    secure, uploads = fleet()
    masked(secure, uploads, DEVICES)
    claimed = request(stages.CONFIRM, {stages.SURVIVORS: DEVICES[1:]})

    # Execute: the device refuses (the session answers SECAGG_RES with the refusal)
    with pytest.raises(Inconsistent, match="leaves out 'dev0'") as refusal:
        uploads["dev0"].on_stage(claimed)
    reply = {stages.STAGE: stages.CONFIRM, stages.REFUSED: Reason.SECAGG_INCONSISTENT.value,
             stages.DETAIL: str(refusal.value)}
    with pytest.raises(DeviceRefusal) as counted:
        secure.on_reply(stages.CONFIRM, "dev0", reply)

    # Assert
    assert counted.value.reason is Reason.SECAGG_INCONSISTENT
    assert secure.record.refused == [f"dev0 (confirm): {refusal.value}"]


def test_a_refusal_that_is_not_one_is_secagg_invalid():
    secure, _ = fleet()
    with pytest.raises(ProtocolError) as refused:
        secure.on_reply(stages.ADVERTISE, "dev0", {stages.STAGE: stages.ADVERTISE, stages.REFUSED: "because",
                                                   stages.DETAIL: "x"})
    assert refused.value.reason is Reason.SECAGG_INVALID and not isinstance(refused.value, DeviceRefusal)


def test_an_advertise_stage_that_names_a_graph_seed_is_refused():
    # Prepare: a coordinator of version 3 chose the graph
    secure, uploads = fleet()
    config = {**secure.config(stages.ADVERTISE), stages.GRAPH_SEED: bytes(32)}

    # Execute / Assert
    with pytest.raises(Inconsistent, match="names a graph seed"):
        uploads["dev0"].on_stage(request(stages.ADVERTISE, config))
