"""Command-line flags generated from the settings declarations, and the table of them in docs/CONFIGURATION.md.

Every declared setting that a command takes becomes one flag, `--` + its key dashed, with the
setting's help and its default. A flag the user leaves out is None in the parsed namespace, so
the TOML file (or the section's default) decides. Booleans are switches (`--release`,
`--no-release`). Only light modules are imported (no torch): `edgepfl --help` stays instant.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from typing import Any

from edge_sdk.settings import ALL_COMMANDS, Setting, settings_of

from .run_config import SECTIONS


def _argument_type(cls: type, item: Setting) -> type:
    annotation = typing.get_type_hints(cls)[item.name]
    options = [a for a in typing.get_args(annotation) if a is not type(None)]
    return options[0] if options else annotation


def _first_sentence(text: str) -> str:
    return " ".join(text.split()).split(". ")[0].rstrip(".")


def add_setting_flags(parser: argparse.ArgumentParser, command: str,
                      sections: Iterable[str] | None = None, leave_out: Iterable[str] = ()) -> list[str]:
    """Add a flag for every setting `command` takes but the keys in `leave_out`, one argument
    group per section (of `sections` only, when given); returns the keys (the namespace
    attributes) added."""
    keys, leave_out = [], set(leave_out)
    for section, cls in SECTIONS.items():
        if sections is not None and section not in sections:
            continue
        items = [item for item in settings_of(cls) if command in item.commands and item.key not in leave_out]
        if not items:
            continue
        group = parser.add_argument_group(f"[{section}] settings", _first_sentence(cls.__doc__ or ""))
        for item in items:
            kind = _argument_type(cls, item)
            text = f"{item.info.help} (default: {item.shown_default})".replace("%", "%%")
            if kind is bool:
                group.add_argument(item.flag, dest=item.key, action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            else:
                group.add_argument(item.flag, dest=item.key, type=kind, default=None, help=text)
            keys.append(item.key)
    return keys


def given(args: argparse.Namespace, keys: Iterable[str]) -> dict[str, Any]:
    """The settings among `keys` that were given on the command line."""
    return {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}


def section_from(cls: type, args: argparse.Namespace) -> Any:
    """Section `cls` from the flags given in `args` (the rest: its defaults), as a device command
    builds the sections it takes part of."""
    return cls(**{item.name: getattr(args, item.key) for item in settings_of(cls)
                  if getattr(args, item.key, None) is not None})


def flag_table() -> str:
    """docs/CONFIGURATION.md's table of the settings: flag, TOML section, default, commands, meaning."""
    lines = ["| flag | TOML | default | commands | meaning |", "|---|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        for item in settings_of(cls):
            commands = "all" if set(item.commands) == set(ALL_COMMANDS) else ", ".join(item.commands)
            meaning = item.info.help.replace("|", "\\|")
            lines.append(f"| `{item.flag}` | `[{section}] {item.key}` | {item.shown_default} | {commands} "
                         f"| {meaning} |")
    return "\n".join(lines) + "\n"
