"""Numbered releases under a run folder (`coordinator.releases.store`) and the inventory: what
the operator's commands change, what they refuse, and a staged rollout's verdict."""

from __future__ import annotations

import json

import pytest

from coordinator.releases.inventory import Inventory
from coordinator.releases.store import ReleaseError, ReleaseStore, Rollout

SOURCE = {"run_id": "run-a", "round": 3}


def add(store: ReleaseStore, payload: bytes):
    return store.add(payload, {"feature_dim": 4}, SOURCE, None, "test")


def test_versions_are_numbered_and_the_first_becomes_current(tmp_path):
    store = ReleaseStore(tmp_path)
    first, second = add(store, b"one"), add(store, b"two")
    assert (first.version, second.version) == (1, 2)
    current = store.current()
    assert current is not None and current.version == 1
    assert store.data(2) == b"two"
    manifest = json.loads((tmp_path / "releases" / "2" / "manifest.json").read_text())
    assert manifest["sha256"] == second.sha256 and manifest["source"] == SOURCE
    assert second.manifest()["version"] == 2 and "rollback" not in second.manifest()
    assert second.manifest(rollback=True)["rollback"] is True
    assert [entry["action"] for entry in store.read_state().history] == ["published", "promoted", "published"]


def test_the_same_bytes_released_again_add_no_version(tmp_path):
    store = ReleaseStore(tmp_path)
    add(store, b"one")
    assert add(store, b"one").version == 1
    assert [v.version for v in store.versions()] == [1]


def test_a_changed_file_is_refused(tmp_path):
    store = ReleaseStore(tmp_path)
    add(store, b"one")
    store.path(1).write_bytes(b"evil")
    with pytest.raises(ReleaseError, match="does not match its manifest"):
        store.data(1)


def test_accuracy_is_recorded_on_the_manifest(tmp_path):
    store = ReleaseStore(tmp_path)
    add(store, b"one")
    store.set_accuracy(1, 0.93)
    assert store.get(1).accuracy == 0.93


@pytest.mark.parametrize("version, fraction, tolerance, message", [
    (9, 0.5, 0.0, "release 9 does not exist"),
    (2, 0.0, 0.0, "--fraction"),
    (2, 1.5, 0.0, "--fraction"),
    (2, 0.5, -0.1, "--tolerance"),
    (1, 0.5, 0.0, "already the current one"),
])
def test_a_rollout_request_that_cannot_be_carried_out_says_why(tmp_path, version, fraction, tolerance, message):
    store = ReleaseStore(tmp_path)
    add(store, b"one")
    add(store, b"two")
    with pytest.raises(ReleaseError, match=message):
        store.request_rollout(version, fraction, tolerance)
    assert store.read_state().rollout is None


def test_one_rollout_at_a_time(tmp_path):
    store = ReleaseStore(tmp_path)
    for payload in (b"one", b"two", b"three"):
        add(store, payload)
    store.request_rollout(2, 0.5, 0.01)
    with pytest.raises(ReleaseError, match="release 2 is being rolled out"):
        store.request_rollout(3, 0.5, 0.01)


def test_rollback_goes_to_the_release_current_before(tmp_path):
    store = ReleaseStore(tmp_path)
    add(store, b"one")
    with pytest.raises(ReleaseError, match="nothing to roll back to"):
        store.roll_back("why")
    add(store, b"two")
    with store.state() as state:  # a promotion, as the release service records it
        state.current = 2
        state.note("promoted", 2, "canaries held")
    assert store.roll_back("bad in the field") == 1
    current = store.current()
    assert current is not None and current.version == 1
    assert ("rolled back", 2, "bad in the field") in [(e["action"], e["version"], e["reason"])
                                                       for e in store.read_state().history]


def test_rollback_during_a_rollout_ends_it_and_keeps_the_current(tmp_path):
    store = ReleaseStore(tmp_path)
    add(store, b"one")
    add(store, b"two")
    store.request_rollout(2, 0.5, 0.01)
    assert store.roll_back("stop it") == 1
    state = store.read_state()
    assert state.rollout is None and state.current == 1


@pytest.mark.parametrize("candidate, current, tolerance, promoted", [
    (0.90, 0.90, 0.0, True), (0.895, 0.90, 0.01, True), (0.88, 0.90, 0.01, False), (0.95, 0.90, 0.0, True)])
def test_the_verdict_compares_the_canaries_means_within_the_tolerance(candidate, current, tolerance, promoted):
    rollout = Rollout(2, 0.5, tolerance, 0.0, ["a", "b"],
                      {"a": {"candidate": candidate - 0.01, "current": current + 0.01},
                       "b": {"candidate": candidate + 0.01, "current": current - 0.01}})
    verdict, reason = rollout.verdict(1)
    assert verdict is promoted
    assert f"{candidate:.4f} with release 2 against {current:.4f} with release 1" in reason


def test_no_canary_result_is_no_promotion():
    assert Rollout(2, 0.5, 0.01, 0.0, ["a"]).verdict(1) == (False, "no canary reported on release 2")


def test_the_inventory_remembers_what_each_device_runs_and_scored(tmp_path):
    inventory = Inventory(tmp_path)
    inventory.record("weak0", runs=1, runs_sha256="a" * 64, accuracy=0.9, evaluated=2, evaluated_accuracy=0.7,
                     kept="scored lower")
    again = Inventory(tmp_path)
    assert again.runs("weak0") == 1 and again.runs("weak1") is None
    assert again.accuracy_with("weak0", 1) == 0.9
    assert again.accuracy_with("weak0", 2) == 0.7
    assert again.accuracy_with("weak0", 3) is None
