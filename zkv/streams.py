"""Writing to a standard stream whose reader may be gone.

A terminal closed under the process (EIO) or a pipe whose reader exited (EPIPE: ``zkv
replay | head``, a pager quit early, ``| tee`` on a Ctrl-C) must not turn a finished run
into a traceback and status 1, nor stop a supervisor's loop. The line is dropped, and the
stream is pointed at /dev/null from then on, so the bytes left in its buffer do not fail
the interpreter's exit (status 120) and later lines go nowhere.
"""

from __future__ import annotations

import os
from typing import TextIO


def say(text: str, stream: TextIO) -> bool:
    """``text`` and a newline on ``stream``, flushed; False (and the stream silenced) when
    its reader is gone."""
    try:
        print(text, file=stream, flush=True)
    except OSError:
        silence(stream)
        return False
    return True


def silence(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null (nothing when it has none)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # (no file descriptor behind it)
        pass
