"""RunFolder: every file of a run named in one place, all inside the run's folder."""

from __future__ import annotations

from pathlib import Path

from coordinator.run.folder import RunFolder

FILES = ("checkpoint", "metrics", "report", "curves", "release", "body_statistics", "state_dir", "models_dir")


def test_every_file_of_a_run_lies_in_its_folder_under_its_own_name(tmp_path: Path) -> None:
    # Prepare
    folder = RunFolder(tmp_path / "run")

    # Execute
    paths = [getattr(folder, name) for name in FILES]

    # Assert
    assert all(path.is_relative_to(tmp_path / "run") for path in paths)
    assert len(set(paths)) == len(FILES)
    assert folder.release.parent == folder.release_dir


def test_device_files_lie_in_the_state_and_models_folders_by_device_id(tmp_path: Path) -> None:
    # Prepare
    folder = RunFolder(str(tmp_path))

    # Execute
    state, model = folder.device_state("dev007"), folder.device_model("dev007")

    # Assert
    assert state.parent == folder.state_dir and state.name == "dev007"
    assert model.parent == folder.models_dir and model.stem == "dev007" and model.suffix == ".onnx"
    assert folder.device_state("dev008") != state
