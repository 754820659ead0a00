"""Unit tests for coordinator.run.checkpoint (atomic msgpack checkpoints) and report_files.MetricsLog."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from coordinator.run import checkpoint
from coordinator.run.checkpoint import Checkpoint, CheckpointError
from coordinator.run.folder import RunFolder
from coordinator.run.report_files import MetricsLog


def _sample() -> Checkpoint:
    rng = np.random.default_rng(3)
    return Checkpoint(
        run_id="run-1",
        round=4,
        fingerprint="abcd1234abcd1234",
        state={
            "shared": {"body.0.weight": rng.standard_normal((2, 3)).astype(np.float32),
                       "head.bias": np.array([1.5, -0.5], np.float16)},
            "counts": {"n": np.array([3, 0, 9], np.int64), "scalar": np.array(7.0)},
        },
        history={"rounds": [{"round": 1, "outcome": "complete", "bytes_up": 123}], "final": None,
                 "sent": {"train": 10}, "rejections": {}},
    )


# -- save / load ---------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    # Prepare
    path = RunFolder(tmp_path).checkpoint
    saved = _sample()

    # Execute
    checkpoint.save(path, saved)
    loaded = checkpoint.load(path)

    # Assert
    assert loaded is not None
    assert (loaded.run_id, loaded.round, loaded.fingerprint) == ("run-1", 4, "abcd1234abcd1234")
    assert loaded.history == saved.history
    assert set(loaded.state) == {"shared", "counts"}
    for group, arrays in saved.state.items():
        assert set(loaded.state[group]) == set(arrays)
        for key, array in arrays.items():
            got = loaded.state[group][key]
            assert got.dtype == array.dtype and got.shape == array.shape
            np.testing.assert_array_equal(got, array)


def test_loaded_arrays_are_writable_copies(tmp_path):
    # Prepare
    path = tmp_path / "c.msgpack"
    checkpoint.save(path, _sample())

    # Execute
    loaded = checkpoint.load(path)
    assert loaded is not None
    loaded.state["counts"]["n"] += 1

    # Assert
    assert loaded.state["counts"]["n"].tolist() == [4, 1, 10]


def test_missing_checkpoint_is_none(tmp_path):
    assert checkpoint.load(tmp_path / "nothing.msgpack") is None


def test_save_replaces_the_previous_checkpoint(tmp_path):
    # Prepare
    path = tmp_path / "c.msgpack"
    checkpoint.save(path, _sample())
    newer = _sample()
    newer.round = 5

    # Execute
    checkpoint.save(path, newer)

    # Assert
    loaded = checkpoint.load(path)
    assert loaded is not None and loaded.round == 5


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    # Prepare
    out = tmp_path / "out"

    # Execute
    checkpoint.save(RunFolder(out).checkpoint, _sample())
    checkpoint.save(RunFolder(out).checkpoint, _sample())

    # Assert
    assert sorted(p.name for p in out.iterdir()) == [RunFolder(out).checkpoint.name]


def _document(tmp_path) -> dict:
    path = tmp_path / "source.msgpack"
    checkpoint.save(path, _sample())
    return msgpack.unpackb(path.read_bytes(), raw=False)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda doc, raw: b"\xc1\xc1 not msgpack",
        lambda doc, raw: raw[: len(raw) // 2],  # torn file
        lambda doc, raw: b"",
        lambda doc, raw: msgpack.packb([1, 2, 3]),
        lambda doc, raw: msgpack.packb({**doc, "format": 99}),
        lambda doc, raw: msgpack.packb({k: v for k, v in doc.items() if k != "state"}),
        lambda doc, raw: msgpack.packb({k: v for k, v in doc.items() if k != "history"}),
        lambda doc, raw: msgpack.packb({**doc, "state": [1]}),
        lambda doc, raw: msgpack.packb({**doc, "state": {"g": {"w": {"dtype": "object", "shape": [1], "data": b"x"}}}}),
        lambda doc, raw: msgpack.packb({**doc, "state": {"g": {"w": {"dtype": "float32", "shape": [2**40, 2**40, 0],
                                                                      "data": b""}}}}),
    ],
    ids=["garbage", "truncated", "empty", "not-a-map", "format", "no-state", "no-history", "state-list", "bad-dtype",
         "unrepresentable-shape"],
)
def test_corrupt_checkpoint_raises_checkpoint_error(tmp_path, corrupt):
    # Prepare
    document = _document(tmp_path)
    raw = (tmp_path / "source.msgpack").read_bytes()
    path = RunFolder(tmp_path).checkpoint
    path.write_bytes(corrupt(document, raw))

    # Execute / Assert
    with pytest.raises(CheckpointError):
        checkpoint.load(path)


# -- MetricsLog ----------------------------------------------------------------------------


def _rounds(path) -> list[int]:
    return [json.loads(line)["round"] for line in path.read_text().splitlines()
            if json.loads(line).get("event") == "round"]


def test_metrics_log_never_records_a_round_twice(tmp_path):
    # Prepare
    path = RunFolder(tmp_path).metrics
    log = MetricsLog(path)

    # Execute
    log.append({"event": "round", "round": 1, "acc": 0.5})
    log.append({"event": "round", "round": 1, "acc": 0.9})
    log.append({"event": "round", "round": 2, "acc": 0.6})

    # Assert
    assert _rounds(path) == [1, 2]
    assert json.loads(path.read_text().splitlines()[0])["acc"] == 0.5  # the first record stays


def test_metrics_log_never_records_a_round_twice_across_reopen(tmp_path):
    # Prepare
    path = RunFolder(tmp_path).metrics
    MetricsLog(path).append({"event": "round", "round": 1})
    MetricsLog(path).append({"event": "round", "round": 2})

    # Execute
    reopened = MetricsLog(path)
    reopened.append({"event": "round", "round": 2})
    reopened.append({"event": "round", "round": 1})
    reopened.append({"event": "round", "round": 3})

    # Assert
    assert _rounds(path) == [1, 2, 3]


def test_metrics_log_writes_other_events_every_time(tmp_path):
    # Prepare
    path = RunFolder(tmp_path).metrics
    log = MetricsLog(path)

    # Execute
    log.append({"event": "note", "round": 1})
    log.append({"event": "note", "round": 1})

    # Assert
    assert len(path.read_text().splitlines()) == 2


def test_metrics_log_survives_a_line_torn_by_a_crash(tmp_path):
    # Prepare: round 1 complete, then a crash mid-way through round 2's line (no newline)
    path = RunFolder(tmp_path).metrics
    path.write_text(json.dumps({"event": "round", "round": 1}) + "\n" + '{"event": "round", "ro')

    # Execute: the resumed run writes round 2 again
    log = MetricsLog(path)
    log.append({"event": "round", "round": 2})

    # Assert: round 2's new line is readable JSON, not glued to the torn fragment
    readable = []
    for line in path.read_text().splitlines():
        try:
            readable.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    assert [e["round"] for e in readable] == [1, 2]
