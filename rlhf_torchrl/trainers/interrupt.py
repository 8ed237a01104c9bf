"""Stopping a run safely: a first Ctrl-C (SIGINT) or a SIGTERM, which clusters send, lets the
iteration running finish, writes a checkpoint of it and stops with one line that gives the command
that resumes; a second Ctrl-C stops at once, with one line too.

:class:`InterruptHandler` catches the signals while :meth:`PPOTrainer.fit
<rlhf_torchrl.trainers.ppo.PPOTrainer.fit>` runs (in the main thread; the previous handlers come
back after). Under torchrun every process gets the signal, and the processes agree on it at the end
of the iteration (the largest signal number over processes), so that all of them write the
checkpoint of the same iteration and stop together. ``fit`` then raises :class:`RunInterrupted`,
a ``KeyboardInterrupt``: the command prints its message and exits with ``128 + signal`` (130 for
Ctrl-C, 143 for SIGTERM), with no traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

#: the signals that stop a run after its iteration
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def signal_name(signum: int) -> str:
    """``Ctrl-C`` for SIGINT, else the signal's name (``SIGTERM``)."""
    return _NAMES.get(signum) or signal.Signals(signum).name


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal: after its iteration with a checkpoint, or at once.

    Args:
        message: one line: what stopped, where, and how to go on.
        signum: the signal's number.
        iteration: the iterations done when it stopped.
        checkpoint: the checkpoint to resume from (None: none written).
        at_once: stopped in the middle of an iteration (a second Ctrl-C).
    """

    def __init__(self, message: str, *, signum: int, iteration: int,
                 checkpoint: str | None = None, at_once: bool = False):
        super().__init__(message)
        self.message, self.signum, self.iteration = message, signum, iteration
        self.checkpoint, self.at_once = checkpoint, at_once

    @property
    def exit_status(self) -> int:
        """``128 + signal``, as a shell reports a process its signal stopped."""
        return 128 + int(self.signum)

    def __str__(self) -> str:
        return self.message


class InterruptHandler:
    """SIGINT and SIGTERM handlers for the length of a ``with`` block (main thread only; elsewhere
    nothing is installed and the signals keep their handlers).

    The first signal sets ``requested`` and prints one line; a second raises
    :class:`RunInterrupted` at once, where the main thread is.

    Args:
        where: what the run is doing, for the lines (``"iteration 3 of 10"``).
        out: where the first signal's line goes (stderr).
    """

    def __init__(self, where: Callable[[], str], out=None):
        self.where, self.out = where, out
        self.requested: int | None = None  # the first signal's number
        self._previous: dict[int, object] = {}

    def __enter__(self) -> InterruptHandler:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signum
            print(f"{signal_name(signum)}: the run stops after {self.where()}, with a checkpoint "
                  f"(Ctrl-C again to stop at once).", file=self.out or sys.stderr, flush=True)
            return
        raise RunInterrupted(f"Stopped at once by a second {signal_name(signum)} during "
                             f"{self.where()}.", signum=signum, iteration=-1, at_once=True)
