"""The class prototypes weak devices share on each release, pooled for the devices that come next.

A device's latest share on a version is kept as `releases/<n>/prototypes/<device>.npz` (counts
and means; written atomically, one small file a report, so a fleet's reports cost no rewrite of
the others'), loaded back when the release service starts. The pooled result per version is
computed once and again only after a new share.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from edge_sdk.protocol import ArrayGroup
from edge_sdk.store import write_atomic

from .phase import PROTOTYPES, PrototypePool
from .store import ReleaseVersion


class PrototypeShares:
    """The devices' prototype shares of every version under `releases_dir`, for `num_classes` classes."""

    def __init__(self, releases_dir: Path, num_classes: int):
        self.dir = releases_dir
        self.num_classes = num_classes
        self._shares: dict[int, dict[str, ArrayGroup]] = {}  # version -> device -> its latest share
        self._pooled: dict[int, dict[str, ArrayGroup]] = {}  # version -> the groups an EVALUATE carries

    def add(self, device: str, release: ReleaseVersion, share: ArrayGroup, registered_examples: int) -> None:
        """Check `device`'s share on `release` (ValidationError) and keep it, replacing an earlier one."""
        self._pool(release).check(share, registered_examples)
        kept: ArrayGroup = {"counts": share["counts"].astype(np.int64), "means": share["means"].astype(np.float32)}
        buffer = io.BytesIO()
        np.savez(buffer, allow_pickle=False, **kept)
        write_atomic(self._folder(release.version) / f"{device}.npz", buffer.getvalue())
        self._of(release.version)[device] = kept
        self._pooled.pop(release.version, None)

    def pooled(self, release: ReleaseVersion) -> dict[str, ArrayGroup]:
        """The `prototypes` group of an EVALUATE of `release` (none before any device shared)."""
        if release.version not in self._pooled:
            shares = self._of(release.version)
            pool = self._pool(release)
            for share in shares.values():
                pool.add(share, 0)
            self._pooled[release.version] = {PROTOTYPES: pool.result()} if shares else {}
        return self._pooled[release.version]

    def _pool(self, release: ReleaseVersion) -> PrototypePool:
        return PrototypePool(self.num_classes, int(release.metadata["feature_dim"]))

    def _folder(self, version: int) -> Path:
        return self.dir / str(version) / "prototypes"

    def _of(self, version: int) -> dict[str, ArrayGroup]:
        """The shares of `version`, read from disk the first time."""
        if version not in self._shares:
            shares: dict[str, ArrayGroup] = {}
            folder = self._folder(version)
            for path in sorted(folder.glob("*.npz")) if folder.is_dir() else []:
                with np.load(path, allow_pickle=False) as saved:
                    shares[path.stem] = {name: saved[name] for name in saved.files}
            self._shares[version] = shares
        return self._shares[version]
