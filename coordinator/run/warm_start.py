"""Warm starts (`init_from`): a new run's global state begins from another model's arrays.

A fleet retrains as its data grows, and a first run often starts from a pretrained body. The
source is one of:

- a run folder (`--out` of an earlier run): its checkpoint.msgpack, the global state after its
  last completed round;
- a checkpoint (`*.msgpack`, `coordinator.run.checkpoint`);
- a PyTorch state_dict saved with `torch.save(model.state_dict(), path)` (`.pt`, `.pth`), read
  with `weights_only=True`, so nothing but tensors and plain containers is ever unpickled;
- an `.npz` of named arrays, read without pickle.

Arrays are matched by name (the model's state_dict key, e.g. `body.0.weight`) against every group
of the algorithm's initial global state. A match takes the source's value, cast to the state's
dtype; a match of another shape or kind of dtype is refused, naming the array, both shapes and the
source; what the source lacks keeps its fresh initialization and what the state lacks is ignored,
both counted in the run's record (report.json `init_from`). A source with no name in common is
refused: it is surely the wrong file. Only the global state is overlaid: personal parts stay on
the devices, fresh. A resumed run keeps its own checkpoint's state (`apply`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.protocol import ArrayGroup

from . import checkpoint
from .folder import RunFolder

log = logging.getLogger(__name__)

KEY = "init_from"
TORCH_SUFFIXES = (".pt", ".pth")
FORMATS = "a run folder, a checkpoint.msgpack, a PyTorch state_dict (.pt, .pth) or an .npz of named arrays"
NAMES_LOGGED = 5
"""How many names of the arrays kept fresh or ignored the log shows."""


@dataclass(frozen=True)
class WarmStart:
    """What a run started from: the source file, its sha256 and how its arrays were matched."""

    source: str
    sha256: str
    arrays_loaded: int
    arrays_kept_fresh: int
    """Arrays of the initial state the source lacks: they keep their fresh initialization."""
    arrays_ignored: int
    """Arrays of the source the state lacks (e.g. BatchNorm statistics, which stay personal)."""

    def record(self) -> dict[str, Any]:
        """The run's record of it: its checkpoint's history and report.json `init_from`."""
        return asdict(self)


def source_file(init_from: str) -> Path:
    """The file `init_from` names: itself, or a run folder's checkpoint; refused by key when absent."""
    path = Path(init_from)
    if path.is_dir():
        path = RunFolder(path).checkpoint
        if not path.is_file():
            raise ConfigError(f"{KEY}: the folder {init_from} holds no run (no {path.name})")
    elif not path.is_file():
        raise ConfigError(f"{KEY}: {init_from} does not exist (give {FORMATS})")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """The named arrays of the source file `path`, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".msgpack":
        return _checkpoint_arrays(path)
    if suffix in TORCH_SUFFIXES:
        return _state_dict_arrays(path)
    if suffix == ".npz":
        return _npz_arrays(path)
    raise ConfigError(f"{KEY}: {path} is none of the formats accepted: {FORMATS}")


def _checkpoint_arrays(path: Path) -> dict[str, np.ndarray]:
    """A checkpoint's global state, its groups merged by name (a name in two groups is ambiguous)."""
    try:
        saved = checkpoint.load(path)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"{KEY}: {exc}") from None
    assert saved is not None  # source_file found it
    arrays: dict[str, np.ndarray] = {}
    for group, named in saved.state.items():
        for name, array in named.items():
            if name in arrays:
                raise ConfigError(f"{KEY}: {path} holds {name!r} in more than one group (the last: {group!r})")
            arrays[name] = array
    return arrays


def _state_dict_arrays(path: Path) -> dict[str, np.ndarray]:
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for what it refuses
        raise ConfigError(f"{KEY}: {path} is not a state_dict torch loads with weights_only=True: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{KEY}: {path} holds a {type(loaded).__name__}, not a state_dict (names -> tensors)")
    arrays = {}
    for name, tensor in loaded.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{KEY}: {path} is not a state_dict (names -> tensors): {name!r} holds a "
                              f"{type(tensor).__name__}")
        tensor = tensor.detach()
        arrays[str(name)] = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    return arrays


def _npz_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{KEY}: {path} is not an .npz of numeric arrays: {exc}") from None


def overlay(state: dict[str, ArrayGroup], arrays: dict[str, np.ndarray],
            source: str) -> tuple[dict[str, ArrayGroup], list[str], list[str]]:
    """`state` with each array the source names replaced by the source's, cast to the state's dtype;
    with the names of the state's arrays kept fresh and the source's ignored. Refused: a shape or
    dtype kind that differs, and a source with no name in common."""
    overlaid: dict[str, ArrayGroup] = {}
    kept_fresh = []
    for group, named in state.items():
        overlaid[group] = {}
        for name, fresh in named.items():
            if name not in arrays:
                kept_fresh.append(name)
                overlaid[group][name] = fresh
                continue
            given = arrays[name]
            if given.shape != fresh.shape or given.dtype.kind != fresh.dtype.kind:
                raise ConfigError(f"{KEY}: {name!r} is {given.dtype}{list(given.shape)} in {source} but the run's "
                                  f"model has {fresh.dtype}{list(fresh.shape)} (a source of another model?)")
            overlaid[group][name] = np.array(given, dtype=fresh.dtype, order="C")  # keeps a 0-d array 0-d
    matched = {name for named in state.values() for name in named if name in arrays}
    if not matched:
        raise ConfigError(f"{KEY}: {source} has no array in common with the run's global state (source: "
                          f"{_some(list(arrays))}; run: {_some(kept_fresh)})")
    ignored = [name for name in arrays if name not in matched]
    return overlaid, kept_fresh, ignored


def warm_start(init_from: str, state: dict[str, ArrayGroup]) -> tuple[dict[str, ArrayGroup], WarmStart]:
    """The initial `state` overlaid with the arrays of `init_from`, and what was done."""
    path = source_file(init_from)
    overlaid, kept_fresh, ignored = overlay(state, load_arrays(path), str(path))
    loaded = sum(len(named) for named in state.values()) - len(kept_fresh)
    started = WarmStart(str(path), sha256_of(path), loaded, len(kept_fresh), len(ignored))
    log.info("%s %s: %d arrays loaded, %d kept their fresh initialization (%s), %d of the source ignored (%s)",
             KEY, path, loaded, len(kept_fresh), _some(kept_fresh), len(ignored), _some(ignored))
    return overlaid, started


def apply(init_from: str | None, state: dict[str, ArrayGroup],
          history: dict[str, Any] | None) -> tuple[dict[str, ArrayGroup], dict[str, Any] | None]:
    """The run's initial global state and its `init_from` record (None without `init_from`). A
    fresh run (`history` None) starts from `init_from`'s arrays; a resumed run keeps `state`, its
    checkpoint's, and is refused when the file it started from has changed since (two runs from
    different initial models are not one run; a file gone since is no other start, so the resume
    goes on)."""
    if init_from is None:
        return state, None
    if history is None:
        overlaid, started = warm_start(init_from, state)
        return overlaid, started.record()
    recorded: dict[str, Any] = history[KEY]
    path = Path(recorded["source"])
    if path.is_file() and sha256_of(path) != recorded["sha256"]:
        raise ConfigError(f"{KEY}: {path} changed since this run started from it (sha256 {recorded['sha256'][:12]} "
                          "then); restore that file to resume, or start a new run with another --out")
    return state, recorded


def _some(names: list[str]) -> str:
    """A few of `names`, for a message."""
    shown = ", ".join(names[:NAMES_LOGGED])
    return (shown + f", ... ({len(names)} in all)" if len(names) > NAMES_LOGGED else shown) or "none"
