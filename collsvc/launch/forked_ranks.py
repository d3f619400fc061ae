"""Ranks forked by the fork server, seen from ``collsvc run`` (collsvc/launch/fork_server.py is the server).

:class:`ForkServer` starts the server process and asks it for ranks; each :class:`ForkedProcess`
answers what the launcher asks of a ``subprocess.Popen`` (``wait``, ``returncode``, its
``stdout`` and ``stderr`` pipes) and signals its process group through the server, which knows its pid
and is its parent. Standard library only: ``collsvc run`` imports this before it starts its ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from collsvc.launch.fork_server import python_target
from collsvc.launch.parent_watch import supported, wrap_command

_SERVER_MODULE = "collsvc.launch.fork_server"
_CLOSE_WAIT = 5.0  # seconds for the server to exit once its ranks have; then it is killed
_GONE_WAIT = 5.0  # seconds for ranks of a dead server to die of their parent-death signal
_MAX_REPLY = 1 << 16


class ForkedProcess:
    """One rank the fork server started: the parts of ``subprocess.Popen`` the launcher uses.

    Attributes:
        stdout: the read end of the rank's stdout pipe.
        stderr: the read end of the rank's stderr pipe.
        pid: the rank's pid once the server reported it, else None.
        returncode: its exit code once it ended (negative: killed by that signal), else None.
    """

    def __init__(self, server: ForkServer, ident: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.pid: int | None = None
        self.returncode: int | None = None
        self._server = server
        self._ident = ident
        self._ended = threading.Event()

    def wait(self, timeout: float | None = None) -> int:
        """Waits until the rank ended; returns its exit code.

        Raises:
            subprocess.TimeoutExpired: ``timeout`` seconds passed first.
        """
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self._ident}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def signal_group(self, signum: int) -> None:
        """Sends ``signum`` to the rank's process group (the rank and what it started)."""
        self._server.signal(self._ident, signum)

    def _end(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._ended.set()


class ForkServer:
    """The launcher's side of one fork server (collsvc/launch/fork_server.py).

    Args:
        env: the server's environment (a rank's: what the ranks import depends on it).
        pass_fds: descriptors every rank inherits (through the server).
        preload: modules the server loads besides its own list (``script_preloads``).

    Raises:
        OSError: the server could not be started.
    """

    def __init__(self, env: Mapping[str, str], pass_fds: Sequence[int] = (), preload: Sequence[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            command = [sys.executable, "-m", _SERVER_MODULE, str(theirs.fileno()), *preload]
            self._process = subprocess.Popen(
                wrap_command(command, os.getpid()),  # it dies with the launcher, and its ranks with it
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the launcher's terminal is the launcher's to forward
                pass_fds=(theirs.fileno(), *pass_fds),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._channel = ours
        self._lock = threading.Lock()
        self._ranks: dict[int, ForkedProcess] = {}
        self._reader = threading.Thread(target=self._read, name="collsvc-fork-server", daemon=True)
        self._reader.start()

    def start(
        self, ident: int, command: Sequence[str], env: Mapping[str, str], keep_fds: Sequence[int] = ()
    ) -> ForkedProcess:
        """Asks the server for one rank running ``command`` (see ``python_target``) with ``env``.

        Args:
            ident: the rank's identifier in replies (unique per server).
            command: the rank's argv, ``[sys.executable, ...]`` in a form ``python_target`` accepts.
            env: its whole environment.
            keep_fds: descriptors it keeps open (they were passed to the server).

        Raises:
            ValueError: ``command`` is not one the server runs.
            OSError: the server is gone.
        """
        target = python_target(command)
        if target is None:
            raise ValueError(f"the fork server cannot run {list(command)!r}")
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        process = ForkedProcess(self, ident, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))
        request = {"start": ident, "command": target, "env": dict(env), "keep_fds": list(keep_fds)}
        with self._lock:
            self._ranks[ident] = process
        try:
            socket.send_fds(self._channel, [json.dumps(request).encode()], [out_write, err_write])
        except OSError:
            with self._lock:
                self._ranks.pop(ident, None)
            process.stdout.close()
            process.stderr.close()
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        return process

    def signal(self, ident: int, signum: int) -> None:
        """Sends ``signum`` to rank ``ident``'s process group (nothing once the server is gone)."""
        with contextlib.suppress(OSError):
            self._channel.send(json.dumps({"signal": ident, "signum": signum}).encode())

    def close(self) -> None:
        """Tells the server no more ranks come; it exits once its ranks have (killed after a while)."""
        with contextlib.suppress(OSError):
            self._channel.shutdown(socket.SHUT_WR)
        try:
            self._process.wait(timeout=_CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            self._process.kill()  # its ranks die with it (parent-death signal)
            self._process.wait()
        self._reader.join(_CLOSE_WAIT)
        self._channel.close()

    def _read(self) -> None:
        """Delivers the server's replies; when it is gone, its unfinished ranks died with it."""
        while True:
            try:
                data = self._channel.recv(_MAX_REPLY)
            except OSError:
                data = b""
            if not data:
                break
            reply: dict[str, Any] = json.loads(data)
            ident: int = reply["started"] if "started" in reply else reply["exited"]
            with self._lock:
                process = self._ranks.pop(ident, None) if "exited" in reply else self._ranks.get(ident)
            if process is None:
                continue
            if "pid" in reply:
                process.pid = reply["pid"]
            else:
                process._end(reply["returncode"])
        with self._lock:
            orphans, self._ranks = list(self._ranks.values()), {}
        for process in orphans:
            if process.pid is not None:
                _wait_gone(process.pid, _GONE_WAIT)
            process._end(-signal.SIGKILL)


def _wait_gone(pid: int, timeout: float) -> None:
    """Waits up to ``timeout`` seconds for process ``pid`` (not our child) to be gone."""
    try:
        handle = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        select.select([handle], [], [], timeout)
    finally:
        os.close(handle)


def can_fork(command: Sequence[str]) -> bool:
    """Whether a fork server can start ``command``'s ranks on this platform."""
    return supported() and python_target(command) is not None


def signal_group(process: ForkedProcess | subprocess.Popen[bytes], signum: int) -> None:
    """Sends ``signum`` to a rank's process group, however it was started (nothing if it is gone)."""
    if isinstance(process, ForkedProcess):
        process.signal_group(signum)
        return
    with contextlib.suppress(OSError):  # the whole group is gone already
        os.killpg(process.pid, signum)
