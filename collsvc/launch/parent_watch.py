"""Ties a rank's life to the ``collsvc run`` that started it.

``collsvc run`` starts every rank through this file, run by path so that nothing but the standard
library is imported::

    python -I -S .../collsvc/launch/parent_watch.py LAUNCHER_PID -- python train.py ...

It asks Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), checks that
the parent is still the launcher (it may have died before the request took effect), and then replaces
itself with the rank's command (``exec``: same pid, same process group, the setting survives). A
SIGKILLed launcher therefore takes its ranks with it at once, whether the coordinator was embedded in
it or runs elsewhere.

Linux delivers the signal when the *thread* that started the child exits, not the process. The
launcher starts ranks from the thread that then supervises them until every rank has exited, so the
two lifetimes agree. Ranks started any other way (torchrun, mpirun, a plain environment) never pass
through here and are unaffected.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_USAGE = "usage: parent_watch.py LAUNCHER_PID -- COMMAND [ARGS...]"
_EXIT_USAGE = 2
_EXIT_CANNOT_EXEC = 127  # like a shell that cannot find or run the command


def supported() -> bool:
    """Whether this platform can tie a child's life to its parent (Linux only)."""
    return sys.platform.startswith("linux")


def wrap_command(command: Sequence[str], launcher_pid: int) -> list[str]:
    """The argv that runs ``command`` as a rank that dies with ``launcher_pid``.

    Args:
        command: the rank's own argv.
        launcher_pid: the pid of the process that starts the rank (normally ``os.getpid()``).

    Returns:
        ``command`` itself where :func:`supported` is false, else ``command`` behind this file.
    """
    if not supported():
        return list(command)
    # -I: ignore PYTHON* variables and the user's site; -S: no site import. Only the stdlib is needed.
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(launcher_pid), "--", *command]


def set_parent_death_signal(signum: int) -> None:
    """Asks the kernel to send ``signum`` to this process when its parent thread exits.

    Raises:
        OSError: the prctl call failed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")


def main(argv: Sequence[str]) -> NoReturn:
    """Sets the parent-death signal, checks the launcher is still the parent, and execs the command.

    Args:
        argv: ``[LAUNCHER_PID, "--", COMMAND, ARGS...]``.
    """
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print(_USAGE, file=sys.stderr)
        os._exit(_EXIT_USAGE)
    launcher_pid, command = int(argv[0]), list(argv[2:])
    try:
        set_parent_death_signal(signal.SIGKILL)
    except OSError as exc:
        print(f"collsvc run: cannot tie the rank to its launcher: {exc}", file=sys.stderr)
        os._exit(_EXIT_CANNOT_EXEC)
    if os.getppid() != launcher_pid:
        # The launcher died between starting us and the prctl call: we were already orphaned, and the
        # kernel will not signal an orphan. Die the way the setting would have made us die.
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(128 + signal.SIGKILL)  # not reached: SIGKILL cannot be caught
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"collsvc run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        os._exit(_EXIT_CANNOT_EXEC)


if __name__ == "__main__":
    main(sys.argv[1:])
