"""Ctrl-C for the commands the tests start and interrupt.

A shell without job control starts a background command with SIGINT ignored (POSIX), a process
keeps that disposition through exec, and Python then installs no KeyboardInterrupt handler. So a
suite run in the background (`make test &`, some CI runners) would start every command with
Ctrl-C ignored, and a test that interrupts one would see it run on to its end. `restore_ctrl_c`,
given to Popen as `preexec_fn`, starts the command with the default disposition, as a terminal
would.
"""

from __future__ import annotations

import signal


def restore_ctrl_c() -> None:
    """In the child, before exec: SIGINT back to its default (Python then raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
