"""Sending a descriptor over an abstract Unix socket as another OS user (``nobody``), from a chosen
socket name: what a local user who learned a rank's socket names could do. Needs root."""

from __future__ import annotations

import array
import os
import socket

NOBODY = 65534


def send_descriptor_as_nobody(source: bytes, target: bytes, message: bytes, fd: int) -> None:
    """Forks a child that becomes ``nobody``, binds ``source`` and sends ``message`` with ``fd``
    (``SCM_RIGHTS``) to ``target``; returns once it did.

    Raises:
        AssertionError: the child could not send it.
    """
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as impostor:
                impostor.bind(source)
                fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                impostor.sendmsg([message], fds, 0, target)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child running as nobody could not send"
