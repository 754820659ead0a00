"""benchmarks/codec_grid.py and the run cache's data tag: runs on different data folders never share
a cache folder, the goal compares MB to FedAvg+FT's accuracy, DC-PFL's refusal is named."""

from __future__ import annotations

from benchmarks import codec_grid
from benchmarks.runs import bench_config, run_folder_name


def _write(folder, content: bytes) -> str:
    folder.mkdir()
    (folder / "train-labels-idx1-ubyte").write_bytes(content)
    return str(folder)


def test_runs_on_different_data_folders_have_different_cache_folders(tmp_path) -> None:
    small = _write(tmp_path / "small", b"\x00" * 10)
    other = _write(tmp_path / "other", b"\x01" * 10)
    same = _write(tmp_path / "same", b"\x00" * 10)

    names = {d: run_folder_name(bench_config(algorithm="fedavg", dataset="fmnist", data_dir=d))
             for d in (small, other, same)}
    plain = run_folder_name(bench_config(algorithm="fedavg", dataset="fmnist"))

    assert names[small] != names[other]
    assert names[small] == names[same]  # the files, not where they are
    assert "-d" not in plain.split("-s0")[1].rsplit("-", 1)[0]  # no data folder: the name it always had


def _row(algorithm: str, codec: str, curve: list[tuple[int, float, float, float]]) -> dict:
    return {"algorithm": algorithm, "codec": codec, "status": "ok", "curve": curve, "final_accuracy": curve[-1][3],
            "mb_up": curve[-1][1], "mb_down_delivered": curve[-1][2]}


def test_the_goal_compares_mb_to_fedavg_ft_accuracy_against_a_tenth_of_fedavgs() -> None:
    fedavg = _row("fedavg", "fp32", [(1, 10.0, 90.0, 0.80), (2, 20.0, 180.0, 0.90)])  # 200 MB to 0.895
    ft = _row("fedavg_ft", "fp32", [(1, 10.0, 90.0, 0.85), (2, 20.0, 180.0, 0.90)])
    cheap = _row("fedavg_ft", "topk", [(1, 0.5, 9.0, 0.899), (2, 1.0, 18.0, 0.90)])  # 9.5 MB at round 1

    result = codec_grid.goal([fedavg, ft, cheap])

    assert result["fedavg_mb"] == 200.0 and result["budget_mb"] == 20.0
    assert result["met"] and result["best"]["codec"] == "topk" and result["best"]["reached"]["round"] == 1


def test_dc_pfl_refuses_lossy_codecs_and_fedavg_takes_them() -> None:
    assert codec_grid.refusal("dc_pfl", "q4")
    assert codec_grid.refusal("dc_pfl", "fp32") is None
    assert codec_grid.refusal("fedavg", "topk") is None
