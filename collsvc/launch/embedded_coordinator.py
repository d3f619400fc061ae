"""The coordinator ``collsvc run`` embeds when it is given no ``--coordinator``.

It starts on a thread of the launcher while the ranks start, not before them: importing gRPC's server
side and the protocol costs the launcher ~0.2 s of CPU, time the ranks spend importing too. Its port
is reserved first, so the ranks are given the address before anything listens there, and a pipe tells
them when it listens: ``collsvc.init`` waits for that before it dials, rather than meeting a closed
port and gRPC's reconnect backoff (100 ms, then growing by 1.6x). This module imports only the
standard library; the server is imported on the starting thread.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"


class EmbeddedCoordinator:
    """A coordinator on ``127.0.0.1``, on a port reserved before it listens, started on a thread.

    The reservation is a bound socket that never listens: no other process gets the port meanwhile
    unless it asks for ``SO_REUSEADDR`` too, and the server binds it beside that socket (Linux lets a
    socket bind a port whose other sockets all set ``SO_REUSEADDR`` and do not listen). The ranks inherit
    the read end of a pipe (:attr:`ready_signal`) whose write end closes once the server listens. When
    it cannot start (another program listens there first, say), the pipe stays open until :meth:`stop`:
    the ranks are stopped before they dial, and never hand the job token to whatever listens there.

    Args:
        token: the job token every call must carry.
        on_failure: called on the starting thread when the coordinator cannot start, to stop the
            ranks that wait for it.
        heartbeat_interval, heartbeat_timeout: its heartbeat pace (see :func:`collsvc.launch.launcher.embedded_pace`).
    """

    def __init__(
        self,
        token: str,
        *,
        on_failure: Callable[[], None],
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
    ) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.port = 0  # the reserved port, once reserve() returned
        self.error: BaseException | None = None  # why it could not start
        self._token = token
        self._on_failure = on_failure
        self._reserved: socket.socket | None = None
        self._ready_read: int | None = None  # the ready signal's pipe: read end (the ranks inherit it) ...
        self._ready_write: int | None = None  # ... and write end (closed once it listens)
        self._server: Any = None  # the CoordinatorThread, once it listens
        self._settled = threading.Event()  # set when it listens or failed to start
        self._thread = threading.Thread(target=self._serve, name="collsvc-coordinator-start", daemon=True)

    def reserve(self) -> str | None:
        """Reserves a free port; returns the ``host:port`` the ranks are to dial, or None when no port
        could be bound (:attr:`error` holds the ``OSError`` then)."""
        reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            reserved.bind((HOST, 0))
            self._ready_read, self._ready_write = os.pipe()  # not inherited unless passed on (pass_fds)
        except OSError as exc:
            reserved.close()
            self.error = exc
            return None
        self._reserved, self.port = reserved, reserved.getsockname()[1]
        return f"{HOST}:{self.port}"

    @property
    def ready_signal(self) -> tuple[int, str] | None:
        """The read end of the ready pipe for the ranks to inherit, and its ``FD:INODE`` name for
        ``COLLSVC_COORDINATOR_READY_FD`` (see ``config.coordinator_ready_fd``); None before
        :meth:`reserve` succeeded or after :meth:`stop`."""
        if self._ready_read is None:
            return None
        return self._ready_read, f"{self._ready_read}:{os.fstat(self._ready_read).st_ino}"

    def start(self) -> None:
        """Starts the coordinator on the reserved port, on a thread; returns at once.

        Raises:
            RuntimeError: no port was reserved.
        """
        if self._reserved is None:
            raise RuntimeError("reserve() a port before start()")
        self._thread.start()

    def failure(self) -> str:
        """Why it could not start, in one line ("" when it did not fail)."""
        error = self.error
        return "" if error is None else f"cannot start the embedded coordinator: {type(error).__name__}: {error}"

    def wait_settled(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until it listens or failed to start; returns whether it listens."""
        return self._settled.wait(timeout) and self._server is not None

    def _serve(self) -> None:
        try:
            from collsvc.options import CoordinatorOptions
            from collsvc.server.app import CoordinatorThread

            options = CoordinatorOptions(
                host=HOST,
                port=self.port,
                token=self._token,
                heartbeat_interval=self.heartbeat_interval,
                heartbeat_timeout=self.heartbeat_timeout,
            )
            server = CoordinatorThread(options)
            server.start()  # RuntimeError when not listening within its own 30 s
            self._server = server
        except Exception as exc:  # noqa: BLE001 - any failure to start is reported in one line
            self.error = exc
            self._on_failure()
        else:
            self._close_ready_write()  # the ranks dial now
        finally:
            if self._reserved is not None:
                self._reserved.close()  # the server holds the port now, or nobody needs it
            self._settled.set()

    def _close_ready_write(self) -> None:
        if self._ready_write is not None:
            os.close(self._ready_write)
            self._ready_write = None

    def stop(self) -> None:
        """Stops the coordinator once it has finished starting (bounded by the server's start timeout);
        releases the reservation and the pipe of one never started."""
        if self._thread.ident is not None:  # started
            self._settled.wait()
        elif self._reserved is not None:
            self._reserved.close()
        self._close_ready_write()
        if self._ready_read is not None:
            os.close(self._ready_read)
            self._ready_read = None
        if self._server is not None:
            self._server.stop()
