"""Differential privacy on what leaves a device: the `[privacy]` settings both sides share, and
the device's half of the upstream path (clip, then noise, before the upload codec). No torch
here: weak devices import it too; DP-SGD (`dpsgd`) imports torch and Opacus on trainers only."""

from .settings import DP_MODES, PrivacySettings

__all__ = ["DP_MODES", "PrivacySettings"]
