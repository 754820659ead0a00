"""Warm starts (`--init-from`, coordinator/run/warm_start.py): a new run starts from another run's
final global state or from a state_dict file, matched by name; another shape, a file with nothing
in common and a missing path are refused by name; a resumed run keeps its own checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.config.run_config import RunConfig
from coordinator.run import checkpoint
from coordinator.run.warm_start import apply, overlay
from edge_sdk.config import ConfigError
from edge_sdk.protocol import Kind
from loopback_runs import LoopbackFederation, drain, listener

SHARED = "shared"


def model_state_dict(config, seed: int) -> dict[str, np.ndarray]:
    """The run's model, built with another seed, as numpy arrays by state_dict key."""
    from edge_sdk.models import build_model

    model = build_model(config.model_name, config.task(), seed=seed)
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}


def save_state_dict(path, arrays: dict[str, np.ndarray]) -> None:
    import torch

    torch.save({name: torch.from_numpy(array) for name, array in arrays.items()}, path)


class NotATensor:
    """Something a weights-only load must refuse to unpickle."""


@pytest.mark.parametrize("algorithm", ["fedavg", "repper"])  # RepPer's BatchNorm statistics travel, 0-d ones too
def test_a_second_run_starts_from_the_first_runs_final_global_state(federation, tmp_path, algorithm):
    # Prepare: a first run on digits, played to its end
    first_config = federation.config(rounds=1, algorithm=algorithm)
    first = federation.coordinator(first_config)
    for i in range(3):
        federation.start_device(i, 3)
    first.run()
    final = checkpoint.load(federation.folder.checkpoint)
    assert final is not None and final.round == 1
    second = LoopbackFederation(tmp_path / "second", f"{federation.topics.federation}-2")
    trains = listener(second.broker, "train-spy", second.topics.broadcast(Kind.TRAIN), second.topics)
    try:
        config = second.config(rounds=1, algorithm=algorithm, init_from=str(federation.folder.path))
        coordinator = second.coordinator(config)
        for i in range(3):
            second.start_device(i, 3)

        # Execute
        report = coordinator.run()

        # Assert: round 1 of the second run broadcast the first run's final state, every array of it
        broadcast = next(e for e in drain(trains) if e.kind == Kind.TRAIN and e.round == 1)
        assert sorted(broadcast.groups[SHARED]) == sorted(final.state[SHARED])
        for name, array in final.state[SHARED].items():
            np.testing.assert_array_equal(broadcast.groups[SHARED][name], array, err_msg=name)
            assert broadcast.groups[SHARED][name].shape == array.shape, name
        assert report["rounds_completed"] == 1 and report["rounds"][0]["outcome"] == "complete"
        record = report["init_from"]
        assert record["source"] == str(federation.folder.checkpoint)
        assert len(record["sha256"]) == 64
        assert (record["arrays_loaded"], record["arrays_kept_fresh"], record["arrays_ignored"]) == (
            len(final.state[SHARED]), 0, 0)
        saved = checkpoint.load(second.folder.checkpoint)
        assert saved is not None and saved.history["init_from"] == record
    finally:
        second.shutdown()


def test_a_state_dict_of_the_model_is_the_initial_global_state_and_statistics_stay_out(federation, tmp_path):
    # Prepare: the run's model with another seed, saved as PyTorch does
    config = federation.config(init_from=str(tmp_path / "pretrained.pt"))
    arrays = model_state_dict(config, seed=7)
    save_state_dict(tmp_path / "pretrained.pt", arrays)

    # Execute
    coordinator = federation.coordinator(config)

    # Assert: every shared array is the file's; the BatchNorm statistics (personal) were ignored
    shared = coordinator.algorithm.state[SHARED]
    for name, array in shared.items():
        np.testing.assert_array_equal(array, arrays[name], err_msg=name)
    ignored = set(arrays) - set(shared)
    assert ignored and all("running" in name or "num_batches" in name for name in ignored)
    assert coordinator.init_from["arrays_loaded"] == len(shared)
    assert (coordinator.init_from["arrays_kept_fresh"], coordinator.init_from["arrays_ignored"]) == (0, len(ignored))


def test_a_pretrained_body_leaves_the_head_freshly_initialized(federation, tmp_path):
    # Prepare: only the body's arrays, in an .npz
    config = federation.config(init_from=str(tmp_path / "body.npz"))
    fresh = federation.coordinator(federation.config()).algorithm.state[SHARED]
    body = {name: array for name, array in model_state_dict(config, seed=7).items() if name.startswith("body.")}
    np.savez(tmp_path / "body.npz", allow_pickle=True, **body)  # the default, named: no array takes its place

    # Execute
    state = federation.coordinator(config).algorithm.state[SHARED]

    # Assert
    heads = [name for name in state if not name.startswith("body.")]
    assert heads
    for name in heads:
        np.testing.assert_array_equal(state[name], fresh[name], err_msg=name)
    assert set(state) - set(heads) <= set(body)
    for name in set(state) - set(heads):
        np.testing.assert_array_equal(state[name], body[name], err_msg=name)
    assert not np.array_equal(state["body.0.weight"], fresh["body.0.weight"])  # seed 7 is another model


def test_another_shape_is_refused_naming_the_array_both_shapes_and_the_source(federation, tmp_path):
    # Prepare: the head of a model with 5 classes instead of 10
    config = federation.config(init_from=str(tmp_path / "other.pt"))
    arrays = model_state_dict(config, seed=0)
    rows, width = arrays["head.weight"].shape
    arrays["head.weight"] = np.zeros((rows // 2, width), np.float32)
    save_state_dict(tmp_path / "other.pt", arrays)

    # Execute / Assert
    with pytest.raises(ConfigError) as refused:
        federation.coordinator(config)
    message = str(refused.value)
    assert message.startswith("init_from: 'head.weight'")
    assert f"[{rows // 2}, {width}]" in message and f"[{rows}, {width}]" in message
    assert str(tmp_path / "other.pt") in message


def test_another_kind_of_dtype_is_refused_and_another_precision_is_cast():
    # Prepare
    state: dict[str, dict[str, np.ndarray]] = {SHARED: {"w": np.zeros(3, np.float32), "n": np.zeros((), np.int64)}}

    # Execute
    overlaid, kept_fresh, ignored = overlay(state, {"w": np.ones(3, np.float64), "extra": np.ones(1)}, "src")

    # Assert: cast, and what each side lacks reported
    assert overlaid[SHARED]["w"].dtype == np.float32 and overlaid[SHARED]["w"].tolist() == [1, 1, 1]
    assert (kept_fresh, ignored) == (["n"], ["extra"])
    assert state[SHARED]["w"].tolist() == [0, 0, 0]  # the initial state itself is left alone
    with pytest.raises(ConfigError, match=r"'n' is float32\[\] in src but the run's model has int64\[\]"):
        overlay(state, {"n": np.float32(1.0)}, "src")


def test_a_scalar_array_keeps_its_shape():
    # Prepare: BatchNorm's num_batches_tracked is 0-d; an algorithm whose statistics travel broadcasts it
    state: dict[str, dict[str, np.ndarray]] = {SHARED: {"body.1.num_batches_tracked": np.zeros((), np.int64)}}

    # Execute
    overlaid, _, _ = overlay(state, {"body.1.num_batches_tracked": np.array(7, np.int64)}, "src")

    # Assert: still 0-d, so a device's shape check accepts the broadcast
    loaded = overlaid[SHARED]["body.1.num_batches_tracked"]
    assert loaded.shape == () and loaded.dtype == np.int64 and int(loaded) == 7


def test_a_file_with_nothing_in_common_is_refused(federation, tmp_path):
    # Prepare
    np.savez(tmp_path / "unrelated.npz", x=np.zeros((4, 2)), y=np.zeros(4))
    config = federation.config(init_from=str(tmp_path / "unrelated.npz"))

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"init_from: .*unrelated.npz has no array in common .*source: x, y"):
        federation.coordinator(config)


@pytest.mark.parametrize("name", ["missing.pt", "missing-run"])
def test_a_missing_source_is_refused_naming_the_key(federation, tmp_path, name):
    config = federation.config(init_from=str(tmp_path / name))
    with pytest.raises(ConfigError, match=rf"^init_from: .*{name} does not exist"):
        federation.coordinator(config)


def test_a_folder_without_a_run_and_an_unknown_format_are_refused(federation, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match=r"^init_from: the folder .*empty holds no run"):
        federation.coordinator(federation.config(init_from=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match=r"^init_from: .*weights.bin is none of the formats accepted"):
        federation.coordinator(federation.config(init_from=str(tmp_path / "weights.bin")))


def test_a_pickled_object_is_never_loaded(federation, tmp_path):
    import torch

    torch.save({"head.weight": NotATensor()}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match=r"^init_from: .*evil.pt is not a state_dict torch loads with weights_only"):
        federation.coordinator(federation.config(init_from=str(tmp_path / "evil.pt")))


def test_a_resumed_run_keeps_its_checkpoint_and_is_refused_when_its_source_changed(tmp_path):
    # Prepare: a run started from source.npz
    source = tmp_path / "source.npz"
    np.savez(source, w=np.ones(2, np.float32))
    fresh: dict[str, dict[str, np.ndarray]] = {SHARED: {"w": np.zeros(2, np.float32)}}
    started, record = apply(str(source), fresh, None)
    assert record is not None and started[SHARED]["w"].tolist() == [1, 1]
    saved: dict[str, dict[str, np.ndarray]] = {SHARED: {"w": np.full(2, 3, np.float32)}}

    # Execute / Assert: the same file, then gone: the checkpoint's state is kept, nothing overlaid
    assert apply(str(source), saved, {"init_from": record}) == (saved, record)
    source.unlink()
    assert apply(str(source), saved, {"init_from": record}) == (saved, record)
    assert saved[SHARED]["w"].tolist() == [3, 3]

    # Execute / Assert: another file at that path
    np.savez(source, w=np.full(2, 2, np.float32))
    with pytest.raises(ConfigError, match=r"^init_from: .*source.npz changed since this run started from it"):
        apply(str(source), saved, {"init_from": record})


def test_init_from_enters_the_fingerprint_only_when_set():
    plain = RunConfig.of(algorithm="fedavg")
    assert "init_from" not in plain.defining()
    assert RunConfig.of(algorithm="fedavg", init_from="runs/a").fingerprint() != plain.fingerprint()
    assert RunConfig.of(algorithm="fedavg", init_from="runs/a").fingerprint() != \
        RunConfig.of(algorithm="fedavg", init_from="runs/b").fingerprint()


def test_an_empty_init_from_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="init_from"):
        RunConfig.of(init_from=" ")
